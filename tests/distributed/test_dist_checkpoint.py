"""Multi-process tests of saveload (from tests/unit/checkpoint/test_saveload.py), on gloo ranks."""

import torch
from checks import assert_state_equal
from dist_cases import DropNet, batch, dropnet_pipe

import fxpipe


def test_two_ranks_resume_bitwise_and_reshard_to_three_stages_and_the_plain_model(tmp_path, launch):

    for case in ("resume_first", "resume_second"):  # the second in new processes
        results = launch(case, 2, "1f1b", tmp_path)
        assert all(r["ok"] for r in results), [r.get("traceback") for r in results]
        if case == "resume_first":
            own = [r["own_bytes"] for r in results]
            assert all("extra= must hold" in r["refused"] for r in results)
            assert "rank 1 could not get ready to save" in results[0]["told"], results[0]["told"]
            assert "not the model's" in results[0]["told"] and "not the model's" in results[1]["told"]
            assert all(r["told_after"] < 20 for r in results)  # not the 60 s timeout
            assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.incomplete").exists()
    assert all(r["extra"] == {"step": 5} for r in results)
    for r in range(2):  # (a) the last 5 losses and the final parameters, bitwise
        straight, resumed = torch.load(tmp_path / f"straight{r}.pt"), torch.load(tmp_path / f"resumed{r}.pt")
        assert resumed["losses"] == straight["losses"][5:]
        assert resumed["params"].keys() == straight["params"].keys()
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), (r, name)
    ckpt = tmp_path / "ckpt"
    for r in range(2):  # each rank's file holds its stage's parameters and Adam's two moments
        size = (ckpt / f"__{r}_0.distcp").stat().st_size
        assert abs(size - 3 * own[r]) < 0.1 * 3 * own[r], (r, size, own[r])
    saved = [torch.load(tmp_path / f"saved{r}.pt") for r in range(2)]
    params = {**saved[0]["params"], **saved[1]["params"]}
    optim = {**saved[0]["optim"], **saved[1]["optim"]}
    # (b) into 3 stages split elsewhere, and into the plain model
    model, pipe, opt = dropnet_pipe(3, split_points=["layers.1", "layers.5"])
    assert fxpipe.load(pipe, ckpt, optimizer=opt) == {"step": 5}
    assert_state_equal(model, opt, params, optim)
    plain = DropNet()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    fxpipe.load(plain, ckpt, optimizer=plain_opt)
    assert_state_equal(plain, plain_opt, params, optim)
    state = fxpipe.load_state_dict(ckpt)
    assert state.keys() == params.keys() and all(torch.equal(state[k], v) for k, v in params.items())
    # and as weights= for a model built on meta
    with torch.device("meta"):
        meta = DropNet()
    fxpipe.compile(meta, 2, example_inputs=(batch(0)[0],), weights=ckpt)
    assert all(torch.equal(meta.state_dict()[k], v) for k, v in params.items())


def test_pipeline_and_data_parallel_save_together_and_resume_replicated_and_sharded(tmp_path, launch):

    results = launch("dp_resume", 4, "1f1b", tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        for mode in ("shard0", "shard1"):  # after the load, one more step gives the same parameters
            assert res[mode] and all(res[mode].values()), (r, mode, res[mode])
    state = fxpipe.load_state_dict(tmp_path / "dp1")  # the sharded one, whole, in one process
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]


def test_ranks_saving_to_different_paths_are_refused_and_a_strict_load_names_foreign_keys(tmp_path, launch):
    # before: rank 0 published a checkpoint lacking rank 1's file, and a strict load on a rank ignored foreign keys
    results = launch("ckpt_cases:paths_differ", 2, "1f1b", tmp_path)
    for res in results:
        assert res["paths"].startswith("CheckpointError: the ranks passed different paths or extra= to "
                                       "fxpipe.save (rank 0: path "), res
        assert "Nothing was written" in res["paths"]
        assert "unexpected keys ['5.weight']" in res["strict"], res
    assert "step-10" in results[0]["listing"] and not [f for f in results[0]["listing"] if f.startswith("step-10-")]
