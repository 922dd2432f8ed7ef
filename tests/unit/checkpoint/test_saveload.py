"""Save and resume with torch.distributed.checkpoint: bitwise resume, reshard to any plan, all or nothing."""

import multiprocessing as mp
import os
import shutil
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from dist_cases import DropNet, batch, dropnet_pipe
from models import TiedTransformer

import fxpipe

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train(pipe_or_model, opt, start, stop, save=None):
    """Run Adam steps ``start..stop`` in one process; return the losses."""
    losses = []
    for i in range(start, stop):
        x, y = batch(i)
        opt.zero_grad()
        if isinstance(pipe_or_model, fxpipe.Pipe):
            loss = pipe_or_model.step(x, target=y, loss_fn=F.mse_loss)
        else:
            loss = F.mse_loss(pipe_or_model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
        if save is not None and save[1] == i + 1:
            fxpipe.save(pipe_or_model, save[0], optimizer=opt, extra={"step": i + 1})
    return losses


def test_a_resumed_run_in_one_process_continues_bitwise(tmp_path):
    model, pipe, opt = dropnet_pipe(2)
    straight = _train(pipe, opt, 0, 10)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    model, pipe, opt = dropnet_pipe(2)
    _train(pipe, opt, 0, 5, save=(tmp_path / "ckpt", 5))
    model, pipe, opt = dropnet_pipe(2)
    torch.manual_seed(123)  # another RNG state: load brings back the saved one
    assert fxpipe.load(pipe, tmp_path / "ckpt", optimizer=opt) == {"step": 5}
    assert _train(pipe, opt, 5, 10) == straight[5:]
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name]), name


def _killed_save(out: str) -> None:
    """Save a checkpoint, then die by SIGKILL in the middle of saving over it."""
    torch.manual_seed(0)
    model = DropNet()
    pipe = fxpipe.compile(model, 2, example_inputs=(batch(0)[0],), chunks=2)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    _train(pipe, opt, 0, 2, save=(os.path.join(out, "ckpt"), 2))
    torch.save(model.state_dict(), os.path.join(out, "first.pt"))
    _train(pipe, opt, 2, 3)
    calls = []
    real_save = torch.save

    def dying_save(*args, **kwargs):  # the checkpoint writer saves tensor by tensor
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(*args, **kwargs)

    torch.save = dying_save
    fxpipe.save(pipe, os.path.join(out, "ckpt"), optimizer=opt, extra={"step": 3})


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_a_save_killed_half_way_leaves_the_previous_checkpoint_and_is_refused(tmp_path):
    proc = mp.get_context("spawn").Process(target=_killed_save, args=(str(tmp_path),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    assert (tmp_path / "ckpt.incomplete" / "__0_0.distcp").exists()  # it died writing
    model = DropNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert fxpipe.load(model, tmp_path / "ckpt", optimizer=opt) == {"step": 2}  # the previous one
    first = torch.load(tmp_path / "first.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in first.items())
    with pytest.raises(fxpipe.CheckpointError, match=r"half-written: its save was interrupted"):
        fxpipe.load(model, tmp_path / "ckpt.incomplete")
    shutil.move(tmp_path / "ckpt.incomplete", tmp_path / "later.incomplete")
    with pytest.raises(fxpipe.CheckpointError, match=r"'.*later' is half-written"):
        fxpipe.load(model, tmp_path / "later")
    with pytest.raises(fxpipe.WeightsError, match=r"half-written"):
        fxpipe.materialize(DropNet(), weights=tmp_path / "later")


# -- refusals ----------------------------------------------------------------------------------------
def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path):
    _, pipe, opt = dropnet_pipe(2)
    fxpipe.save(pipe, tmp_path / "ckpt", optimizer=opt)
    other = TiedTransformer()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(fxpipe.CheckpointError, match=r"not of this model: 40 missing FQN\(s\) \['pos', 'embed.weight'"
                                                     r".*, ... 30 more\]; 12 unexpected FQN\(s\) \['layers.0.bias'"):
        fxpipe.load(other, tmp_path / "ckpt")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())
    wider = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.Linear(192, 64)] + [
        torch.nn.Linear(192, 192) for _ in range(5)])})
    with pytest.raises(fxpipe.CheckpointError, match=r"mismatches: 'layers.0.weight': \(192, 192\) torch.float32 "
                                                     r"there, \(64, 192\) torch.float32 here"):
        fxpipe.load(wider, tmp_path / "ckpt")


def test_optimizer_refusals(tmp_path):
    _, pipe, opt = dropnet_pipe(2)
    fxpipe.save(pipe, tmp_path / "plain")
    with pytest.raises(fxpipe.CheckpointError, match="holds no optimizer state; load it without optimizer="):
        fxpipe.load(pipe, tmp_path / "plain", optimizer=opt)
    fxpipe.save(pipe, tmp_path / "adam", optimizer=opt)
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(fxpipe.CheckpointError, match=r"holds Adam state; the optimizer given is SGD: build the "
                                                     r"optimizer it was saved with \(class Adam\)"):
        fxpipe.load(pipe, tmp_path / "adam", optimizer=sgd)


def test_what_is_not_a_checkpoint_is_refused(tmp_path):
    model, pipe, _ = dropnet_pipe(2)
    with pytest.raises(fxpipe.CheckpointError, match=r"no checkpoint at .*nothing'.*: pass the directory fxpipe.save "
                                                     r"wrote \(fxpipe.latest_checkpoint\(folder\) gives the newest"):
        fxpipe.load(pipe, tmp_path / "nothing")
    fxpipe.save(pipe, tmp_path / "step-3")  # a typo beside real saves names them
    with pytest.raises(fxpipe.CheckpointError, match="checkpoints beside it: step-3: pass the directory"):
        fxpipe.load(pipe, tmp_path / "step-30")
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=tmp_path / "bare", no_dist=True)
    with pytest.raises(fxpipe.CheckpointError, match="lacks fxpipe.json, which fxpipe.save writes last"):
        fxpipe.load(pipe, tmp_path / "bare")
    with pytest.raises(TypeError, match="extra= must hold what torch.load"):
        fxpipe.save(pipe, tmp_path / "x", extra=object())
    assert not (tmp_path / "x").exists()


def test_tied_weights_are_saved_once_and_come_back_under_both_names_tied_or_not(tmp_path):
    model = TiedTransformer()
    fxpipe.save(model, tmp_path / "ckpt")
    state = fxpipe.load_state_dict(tmp_path / "ckpt")
    assert state["head.weight"] is state["embed.weight"]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    fresh = TiedTransformer()
    fxpipe.load(fresh, tmp_path / "ckpt")
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    untied = TiedTransformer()  # fine-tuning with the head untied: it starts from the tied weight
    untied.head.weight = torch.nn.Parameter(torch.zeros_like(untied.embed.weight))
    fxpipe.load(untied, tmp_path / "ckpt")
    assert torch.equal(untied.head.weight, model.embed.weight) and torch.equal(untied.embed.weight, model.embed.weight)
    with torch.device("meta"):
        meta = TiedTransformer()
    meta.head.weight = torch.nn.Parameter(torch.empty_like(meta.embed.weight))
    fxpipe.materialize(meta, weights=tmp_path / "ckpt")
    assert torch.equal(meta.head.weight, model.embed.weight) and meta.head.weight is not meta.embed.weight


def test_an_optimizer_grouped_otherwise_than_saved_is_refused_before_anything_changes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}])
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    fxpipe.save(model, tmp_path / "ckpt", optimizer=opt)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    one_group = torch.optim.AdamW(fresh.parameters(), weight_decay=0.1)  # the biases' decay would change
    with pytest.raises(fxpipe.CheckpointError, match=r"param group 0 of the optimizer holds '0.weight' and "
                                                     r"'0.bias', saved with different \['weight_decay'\] "
                                                     r"\(weight_decay=0.1 and 0.0\)"):
        fxpipe.load(fresh, tmp_path / "ckpt", optimizer=one_group)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items()) and not one_group.state
    with torch.device("meta"):  # a plain model built on meta gets its weights and its optimizer's state
        on_meta = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    meta_opt = torch.optim.AdamW([{"params": [on_meta[0].weight, on_meta[1].weight], "weight_decay": 0.1},
                                  {"params": [on_meta[0].bias, on_meta[1].bias], "weight_decay": 0.0}])
    fxpipe.load(on_meta, tmp_path / "ckpt", optimizer=meta_opt)
    assert torch.equal(on_meta[1].weight, model[1].weight)
    assert torch.equal(meta_opt.state[on_meta[1].weight]["exp_avg"], opt.state[model[1].weight]["exp_avg"])
    regrouped = torch.optim.AdamW([{"params": biases[::-1]}, {"params": weights[::-1]}])  # the same groups
    fxpipe.load(model, tmp_path / "ckpt", optimizer=regrouped)
    assert [g["weight_decay"] for g in regrouped.param_groups] == [0.0, 0.1]


def test_a_path_with_a_trailing_slash_saves_twice_and_loads(tmp_path):
    model = torch.nn.Linear(3, 4)
    for _ in range(2):  # the second replaces the first
        fxpipe.save(model, f"{tmp_path}/ckpt/", extra={"n": 1})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    fresh = torch.nn.Linear(3, 4)
    assert fxpipe.load(fresh, f"{tmp_path}/ckpt/") == {"n": 1} and torch.equal(fresh.weight, model.weight)
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 4)
    fxpipe.materialize(meta, weights=f"{tmp_path}/ckpt/")
    assert torch.equal(meta.weight, model.weight)


def test_an_lr_scheduler_comes_back_through_extra(tmp_path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8)

    def steps(model, opt, sched, k):
        for _ in range(k):
            opt.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
            sched.step()
        return [opt.param_groups[0]["lr"], model.weight.detach().clone()]

    straight = steps(*build(), 5)
    model, opt, sched = build()
    steps(model, opt, sched, 3)
    fxpipe.save(model, tmp_path / "ckpt", optimizer=opt, extra={"sched": sched.state_dict()})
    model, opt, sched = build()
    sched.load_state_dict(fxpipe.load(model, tmp_path / "ckpt", optimizer=opt)["sched"])
    lr, weight = steps(model, opt, sched, 2)
    assert lr == straight[0] and torch.equal(weight, straight[1])


def test_an_optimizer_state_holding_lists_comes_back_whole(tmp_path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        return model, torch.optim.LBFGS(model.parameters(), history_size=3)

    def step(model, opt):
        def closure():
            opt.zero_grad()
            loss = model(torch.ones(5, 3)).pow(2).sum()
            loss.backward()
            return loss
        opt.step(closure)
        return model[1].weight.detach().clone()

    model, opt = build()
    step(model, opt)
    fxpipe.save(model, tmp_path / "ckpt", optimizer=opt)
    expected = step(model, opt)
    model, fresh = build()
    fxpipe.load(model, tmp_path / "ckpt", optimizer=fresh)
    assert isinstance(fresh.state[model[0].weight]["old_dirs"], list)  # LBFGS's history of tensors
    assert torch.equal(step(model, fresh), expected)


def test_a_directory_or_file_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    # fxpipe.save("ckpt") on a directory holding step-1, step-2 and a config deleted them all
    _, pipe, _ = dropnet_pipe(2)
    ckpt = tmp_path / "ckpt"
    fxpipe.save(pipe, ckpt / "step-1")
    (ckpt / "run-config.yaml").write_text("lr: 0.1\n")
    with pytest.raises(fxpipe.CheckpointError, match=r"holds 2 entries and is not an fxpipe checkpoint .*"
                                                     r"fxpipe.save\(pipe, 'ckpt/step-500'\)"):
        fxpipe.save(pipe, ckpt)
    assert sorted(os.listdir(ckpt)) == ["run-config.yaml", "step-1"]
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(fxpipe.CheckpointError, match="is a file, not a checkpoint directory"):
        fxpipe.save(pipe, tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    fxpipe.save(pipe, ckpt / "step-1")  # an fxpipe checkpoint is replaced, an empty directory is used
    (tmp_path / "empty").mkdir()
    fxpipe.save(pipe, tmp_path / "empty")
    assert fxpipe.latest_checkpoint(ckpt) == str(ckpt / "step-1")


def test_a_checkpoint_missing_a_rank_s_file_and_an_extra_that_cannot_be_pickled_are_refused(tmp_path):
    _, pipe, _ = dropnet_pipe(2)
    with pytest.raises(TypeError, match="extra= must hold what torch.load.*it cannot even be saved"):
        fxpipe.save(pipe, tmp_path / "x", extra={"f": lambda: 1})
    fxpipe.save(pipe, tmp_path / "ok")
    (shard,) = [f for f in os.listdir(tmp_path / "ok") if f.endswith(".distcp")]
    os.remove(tmp_path / "ok" / shard)  # a rank that wrote elsewhere (another path, a node-local disk)
    with pytest.raises(fxpipe.CheckpointError, match=rf"lacks \['{shard}'\], written by other ranks"):
        fxpipe.load(pipe, tmp_path / "ok")
    with pytest.raises(fxpipe.CheckpointError, match="written by other ranks"):
        fxpipe.load_state_dict(tmp_path / "ok")


def test_an_overwrite_stopped_between_its_renames_resumes_from_the_previous_checkpoint(tmp_path, caplog):
    # latest moved to latest.old, the new save not yet moved to latest: latest_checkpoint gave None, and the
    # documented resume loop trained from step 0, silently
    _, pipe, _ = dropnet_pipe(2)
    ckpt = tmp_path / "ckpt"
    fxpipe.save(pipe, ckpt / "latest", extra={"step": 100})
    fxpipe.save(pipe, ckpt / "next", extra={"step": 200})
    os.replace(ckpt / "latest", ckpt / "latest.old")  # where a kill between publish's two renames leaves them
    os.replace(ckpt / "next", ckpt / "latest.incomplete")
    with caplog.at_level("WARNING"):
        found = fxpipe.latest_checkpoint(ckpt)
    assert found == str(ckpt / "latest.old"), found
    assert "an overwrite of 'latest' stopped before it was put in place" in caplog.text
    assert fxpipe.load(pipe, found) == {"step": 100}
    fxpipe.save(pipe, ckpt / "other", extra={"step": 250})  # a newer one beside it is chosen, and nothing said
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert fxpipe.latest_checkpoint(ckpt) == str(ckpt / "other")
    assert "stopped before it was put in place" not in caplog.text
    fxpipe.save(pipe, ckpt / "latest", extra={"step": 300})  # the next save puts latest back; .old is gone
    assert fxpipe.latest_checkpoint(ckpt) == str(ckpt / "latest")


def _qat_model():
    """A fresh quantization-aware model: per-channel fake quantization, whose observers size their buffers when run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    return torch.ao.quantization.prepare_qat(model)


def test_a_quantization_aware_run_resumes_into_a_fresh_model(tmp_path):
    # refused: "'0.weight_fake_quant.scale': (16,) there, (1,) here", where torch's load_state_dict resizes observers
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    trained = _qat_model()
    pipe = fxpipe.compile(trained, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    pipe.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    fxpipe.save(pipe, tmp_path / "ckpt")
    for fresh in (_qat_model(), fxpipe.compile(_qat_model(), 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)):
        fxpipe.load(fresh, tmp_path / "ckpt")
        want = trained.state_dict()
        got = fresh.state_dict()
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), name


def test_a_model_never_filled_on_meta_is_refused_naming_its_tensors(tmp_path):
    # it wrote an empty checkpoint, marked complete, which only the resume refused ("N missing FQN(s)")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(fxpipe.CheckpointError, match=r"4 tensor\(s\) of the model are on the meta device, never "
                                                     r"filled \(0.weight, 0.bias, 2.weight ...\)"):
        fxpipe.save(model, tmp_path / "ckpt")
    assert fxpipe.latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("dropout", [True, False])
def test_a_checkpoint_of_another_world_warns_of_random_generators_only_for_a_model_that_draws(tmp_path, caplog,
                                                                                            dropout):
    # a model with no dropout was told its dropout would draw from this process's generators, on every rank
    torch.manual_seed(0)
    model = DropNet() if dropout else nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    example = batch(0)[0] if dropout else torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(example,), chunks=2)
    fxpipe.save(pipe, tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / "fxpipe.json"
    manifest.write_text(manifest.read_text().replace('"world": 1', '"world": 2'))  # as if saved by 2 ranks
    with caplog.at_level("WARNING", logger="fxpipe"):
        fxpipe.load(pipe, tmp_path / "ckpt")
    assert ("random generators not restored" in caplog.text) == dropout, caplog.text
