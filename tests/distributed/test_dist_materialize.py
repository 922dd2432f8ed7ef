"""Multi-process tests of materialize (from tests/unit/materialize/test_materialize.py), on gloo ranks."""

import torch
from models import TiedTransformer, deferred, tensors

import fxpipe


def test_meta_models_across_two_ranks_hold_and_read_only_their_stage_or_refuse(tmp_path, launch):

    real = TiedTransformer()
    torch.save(real.state_dict(), tmp_path / "tied.pt")
    results = launch("meta", 2, "1f1b", tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        for name in ("unet", "tied", "cnn"):
            case = res[name]
            assert case["loss_error"] < 1e-5 and case["grad_errors"], (r, name)
            assert max(case["grad_errors"].values()) < 1e-5, (r, name, case["grad_errors"])
            assert case["wrong"] == [], (r, name)  # held tensors real, every other on meta
            assert max(case["buffer_errors"].values(), default=0) < 1e-5, (r, name, case["buffer_errors"])
        assert any("running_var" in n for n in res["cnn"]["buffer_errors"])  # deferred batch norm, as eager
    for name in ("unet", "tied"):
        owned = [set(res[name]["owned"]) for res in results]
        assert owned[0] | owned[1] == set(results[0][name]["all"])
        assert 0 < len(owned[0]) < len(results[0][name]["all"])
    assert {"embed.weight", "head.weight"} <= set(results[1]["tied"]["owned"])  # tied: on both ranks
    for res in results:  # each rank read only the FQNs it holds (a tied tensor under one name)
        assert set(res["read"]) <= set(res["tied"]["owned"])
    assert not set(results[0]["read"]) & set(results[1]["read"]) - {"embed.weight"}
    for res in results:  # weights lacking a tensor of the last stage: every rank refuses, holding nothing
        kind, message, untouched = res["missing"]
        assert kind == "WeightsError" and "lacks 1 FQN(s) of the model: 'norm.weight'" in message
        assert untouched
    # a path only rank 0 sees: rank 1 refused it, and rank 0 waited out timeout= for a raw DistStoreError
    kind, message, seconds = results[1]["one_rank_path"]
    assert kind == "WeightsError" and "tied.pt.elsewhere" in message, message
    kind, message, seconds = results[0]["one_rank_path"]
    assert kind == "PeerFailure" and "rank 1 refused its weights=" in message and seconds < 20, (message, seconds)


def test_two_ranks_materialize_only_their_stage_equal_to_one_process(tmp_path, launch):

    results = launch("deferred", 2, "1f1b", tmp_path, limit=60)
    reference = tensors(fxpipe.materialize(deferred(), seed=3))
    held = []
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["wrong"] == [] and res["loss_error"] < 1e-5, (r, res)
        assert max(res["grad_errors"].values()) < 1e-5, (r, res["grad_errors"])
        mine = torch.load(tmp_path / f"deferred{r}.pt")
        for name, value in mine.items():
            assert torch.equal(value, reference[name]), (r, name)
        held.append(set(mine))
    assert held[0] | held[1] == set(reference) and held[0] != held[1]
    assert any(n.endswith("inv_freq") for n in held[1]) and {"embed.weight", "head.weight"} <= held[1]
