"""Pipeline x tensor parallel (and x data parallel) on gloo ranks: equal to eager, collectives, memory, checkpoints.

Cases in tests/support/tp_cases.py. Global rank = (replica * pp + pipeline rank) * tp + tp index.
"""

from __future__ import annotations

from collections import Counter

import pytest

_MODELS = "mlp,decoder,llama"  # residual MLP; tied decoder with hard-coded heads; Hugging Face Llama (export)


def _ok(results):
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('type')}: {res.get('message')}\n{res.get('traceback')}"


def _equal(results, models):
    _ok(results)
    for r, res in enumerate(results):
        for name in models.split(","):
            got = res[name]
            assert got["loss_error"] < 1e-5, (r, name, got["loss_error"])
            assert max(got["grad_errors"].values()) < 1e-5, (r, name, got["grad_errors"])
            assert got["norm_error"] < 1e-5 and max(got["clipped_errors"].values()) < 1e-5, (r, name, got)
            assert got["sharded"], (r, name)  # tensor parallelism really split weights


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved"])
def test_pp2_tp2_equals_eager(schedule, tmp_path, launch):
    pytest.importorskip("transformers")
    _equal(launch("tp_cases:equal", 4, f"{_MODELS}/{schedule}", tmp_path, limit=240), _MODELS)


def test_a_vocabulary_parallel_padding_row_learns_nothing_as_in_eager(tmp_path, launch):
    """An embedding's padding row on the second rank's shard learns only through the tied head (module and export).

    torch.export's graph calls aten.embedding with the padding index: the module made from it keeps it.
    """
    _equal(launch("tp_cases:equal", 4, "padded,padded_export/1f1b", tmp_path, limit=240), "padded,padded_export")


def test_an_embedding_holding_another_tensor_is_made_vocabulary_parallel(tmp_path, launch):
    """Gemma's embedding scales its output by a buffer of its own (embed_scale): the read of it was left
    pointing at the replaced module, and compile failed in torch.fx's lint."""
    _equal(launch("tp_cases:equal", 4, "scaled/1f1b", tmp_path, limit=240), "scaled")


@pytest.mark.parametrize("models, schedule", [("mlp", "1f1b"), ("decoder", "zb:shard"),
                                              ("decoder", "interleaved")])
def test_pp2_dp2_tp2_equals_eager(models, schedule, tmp_path, launch):
    _equal(launch("tp_cases:equal", 8, f"{models}/{schedule}", tmp_path, limit=240), models)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_selective_and_per_stage_policies_equal_eager(schedule, tmp_path, launch):
    """Selective recomputation keeps a DTensor's saved views (as_strided cannot remake them): equal to eager."""
    results = launch("tp_cases:policies", 4, schedule, tmp_path, limit=240)
    _ok(results)
    for r, res in enumerate(results):
        for name in ("selective", "per_stage", "auto"):
            got = res[name]
            assert got["loss_error"] < 1e-5 and max(got["grad_errors"].values()) < 1e-5, (r, name, got)
        assert res["per_stage"]["policies"] == ["selective", "always"]


def _counts(seen, when):
    return Counter(k for k, p in seen if p == when)


@pytest.mark.parametrize("schedule", ["zb", "1f1b:shard"])
def test_whole_weights_beside_a_shard_get_the_groups_summed_gradient(schedule, tmp_path, launch):
    """Qwen3's per-head q_norm/k_norm: each rank's gradient covered its own heads only (53-100% off)."""
    _equal(launch("tp_cases:equal", 4 if ":" not in schedule else 8, f"qknorm/{schedule}", tmp_path, limit=240),
           "qknorm")


@pytest.mark.parametrize("schedule", ["1f1b:shard", "zb"])
def test_whole_weights_beside_a_shard_accumulate_over_a_no_sync_step(schedule, tmp_path, launch):
    """FSDP2 keeps a no_sync step's gradients unsharded until the synced step: the sum covers both (114% off)."""
    results = launch("tp_cases:accumulate", 4, schedule, tmp_path, limit=240)
    _ok(results)
    for r, res in enumerate(results):
        assert max(res["grad_errors"].values()) < 1e-5, (r, res["grad_errors"])


def test_sequence_parallel_plan_equals_eager(tmp_path, launch):
    """torchtitan's sequence-parallel plan (norms on DTensors, the residual stream a shard of the sequence), zb."""
    _equal(launch("tp_cases:equal", 4, "sp/zb", tmp_path), "sp")


def test_megatron_collective_count(tmp_path, launch):
    """The automatic plan on residual MLP blocks: one all-reduce forward and one backward per block per micro-batch."""
    results = launch("tp_cases:count", 2, "mlp", tmp_path)
    _ok(results)
    for res in results:
        per = res["blocks"] * res["chunks"]
        assert [k for k, p in res["seen"] if p == "forward"] == ["all_reduce"] * per, res["seen"]
        assert [k for k, p in res["seen"] if p == "backward"] == ["all_reduce"] * per, res["seen"]
        recorded = [c for call in res["recorded"] for c in call["collectives"]]
        assert sorted((p, k) for p, k, _ in recorded) == [("backward", "all_reduce")] * res["blocks"] + \
            [("forward", "all_reduce")] * res["blocks"]
        assert res["loss_error"] < 1e-5 and max(res["grad_errors"].values()) < 1e-5


def test_query_key_value_share_one_backward_all_reduce(tmp_path, launch):
    """Megatron's fused-QKV count without fusing: q, k, v reading one input all-reduce its gradient once.

    Per micro-batch, 2 blocks: forward the embedding's and 2 per block (attention out, MLP out) all-reduces
    and the tied head's all-gather; backward one per block for q, k, v, one per MLP, one for the head.
    """
    results = launch("tp_cases:count", 2, "decoder", tmp_path)
    _ok(results)
    for res in results:
        m, blocks = res["chunks"], res["blocks"]
        assert _counts(res["seen"], "forward") == {"all_reduce": m * (1 + 2 * blocks), "all_gather_into_tensor": m}
        assert _counts(res["seen"], "backward") == {"all_reduce": m * (2 * blocks + 1)}
        recorded = Counter(p for call in res["recorded"] for p, _, _ in call["collectives"])
        assert recorded == {"forward": 2 + 2 * blocks, "backward": 2 * blocks + 1}
        assert res["loss_error"] < 1e-5 and max(res["grad_errors"].values()) < 1e-5


def test_meta_build_holds_its_shard(tmp_path, launch):
    """A model built on meta, the layout a 3-D mesh=: each rank's parameter bytes of its stage <= 0.55x the whole's (t=2)."""
    results = launch("tp_cases:memory", 4, "1f1b", tmp_path)
    _ok(results)
    for r, res in enumerate(results):
        assert not res["meta_left"] and res["size"] == 2, r
        assert res["local"] <= 0.55 * res["whole"], (r, res["local"] / res["whole"])
    assert len({res["loss"] for res in results}) == 1


def test_checkpoint_reshards(tmp_path, launch):
    """Saved at pp=2 x tp=2, loaded at tp=1 over 3 stages, at tp=4 over 1, and by the plain module: equal next step."""
    saved = launch("tp_cases:save_tp", 4, "1f1b", tmp_path)
    _ok(saved)
    want = saved[0]["next_loss"]
    for world, tp in ((3, "tp1"), (4, "tp4")):
        loaded = launch("tp_cases:load_tp", world, tp, tmp_path)
        _ok(loaded)
        for res in loaded:
            assert abs(res["next_loss"] - want) <= 1e-5 * abs(want), (tp, res, want)
            assert abs(res["plain_loss"] - want) <= 1e-5 * abs(want), (tp, res, want)


def test_autocast_and_loss_scaling(tmp_path, launch):
    """bf16 autocast over the shards; an fp16 overflow on one rank's shard skips the step on every rank."""
    results = launch("tp_cases:mixed", 4, "1f1b", tmp_path)
    _ok(results)
    for r, res in enumerate(results):
        assert res["bf16_loss_error"] < 1e-2 and res["bf16_vs_fp32"] > 1e-5, (r, res)  # bf16 really ran
        assert res["skipped"] and res["scale"] == 512.0 and res["then_stepped"], (r, res)
        assert not res["warned"], res  # torch's implicit-replication warning on the scale, every rank's every run
    assert len({res["fp16_loss"] for res in results}) == 1


def test_a_value_for_an_input_the_trace_fixed_given_later_on_one_rank_is_refused_on_every_rank(tmp_path, launch):
    # at a later call (no glance under tensor parallelism) rank 3's mask= was ignored, silently
    results = launch("tp_cases:fixed_later", 4, "1f1b", tmp_path, limit=120)
    _ok(results)
    for r, res in enumerate(results):
        kind, message = res["later"]
        assert kind != "returned" and "mask= was fixed to None" in message, (r, res)


def test_inputs_or_target_on_the_wrong_rank_of_a_tensor_parallel_group_are_refused_on_every_rank(tmp_path, launch):
    # the target on the first stage's ranks only was checked by one pipeline row of the group and not the other:
    # the two ranks of the last stage's group then parted ways in their collectives (gloo's raw error)
    results = launch("tp_cases:misuse", 4, "1f1b", tmp_path, limit=120)
    _ok(results)
    for r, res in enumerate(results):
        kind, message = res["target_on_first"]
        assert kind == "PipelineInputError" and "target=None on ranks 2, 3, which compute the loss" in message, (r, res)
        # "got a target on ranks 0, 1" where one of them had it
        assert "got a target on the first stage's tensor-parallel group (ranks 0, 1)" in message, (r, res)
        assert res["devices"] == ["ranks 0, 1 (cpu)", "ranks 2, 3 (cpu)"], res  # stage 1 on "rank 1 (cpu)"
        assert "pass the target on rank 2 or 3 (the last stage: any rank of its tensor-parallel group" in message
        # every rank given its own rows: each group took its first rank's, so rank 1's and rank 3's rows were lost
        # and rank 2's target trained against rank 0's inputs, silently
        kind, message = res["own_rows"]
        assert kind == "PipelineInputError" and "rank 1 was given another input 'x' than rank 0, the first of its " \
            "tensor-parallel group (ranks 0, 1)" in message and "fxpipe.data_shard(pipe)" in message, (r, res)
        kind, message = res["no_inputs"]  # it named every group's ranks as the ones without inputs
        assert kind == "PipelineInputError" and "got no inputs on any rank of the tensor-parallel group of ranks " \
            "0 and 1: pass the inputs on rank 0 or 1" in message, (r, res)
        kind, message = res["target_on_first_later"]  # it failed the step on the loss's ranks alone: every later
        assert kind == "PipelineInputError" and "target=None on ranks 2, 3" in message, (r, res)  # step refused
        kind, message = res["group_targets_differ"]
        assert kind == "PipelineInputError" and "rank 3 was given another target than rank 2" in message, (r, res)
        # the inputs and the target on each group's second rank only (the target on the world's last rank, as a
        # script without tensor parallelism passes it): the group takes them from that rank
        kind, loss = res["on_second"]
        assert kind == "returned" and abs(loss - res["expected"]) <= 1e-5 * abs(res["expected"]), (r, res)
        assert max(res["after"]) < 1e-5, (r, res)


def test_a_call_one_rank_makes_differently_is_refused_on_every_rank_and_the_pipe_steps_on(tmp_path, launch):
    # pipe(x) on one rank while the others stepped was refused by that rank's pipeline only: the other tp index's
    # ranks waited out timeout= in the stage's collectives, and the pipe had to restart (so did a mode, autocast or
    # loss_reduction differing on one rank, and one rank's refusal of its own arguments)
    results = launch("tp_cases:calls_differ", 4, "1f1b", tmp_path, limit=150)
    _ok(results)
    for r, res in enumerate(results):
        for odd in range(4):
            kind, message, seconds = res[f"infers_{odd}"]
            assert kind == "PipelineInputError" and seconds < 10, (r, odd, res)
            assert message.startswith(f"rank {odd} called pipe(...) but rank {1 if odd == 0 else 0} called "
                                      "pipe.step: every rank makes the same call"), message
        kind, message, seconds = res["mistake_0"]
        assert kind == "PipelineInputError" and seconds < 10 and message.startswith("rank 0 called pipe(...)"), res
        kind, message, seconds = res["mistake_1"]  # rank 1's own refusal of a step under no_grad, on every rank
        assert kind == "RuntimeError" and seconds < 10 and "pipe.step runs backward and needs autograd" in message
        assert message.startswith("rank 1: ") or r == 1, message
        kind, message, seconds = res["mistake_2"]
        assert kind == "PipelineInputError" and seconds < 10, res
        assert message.startswith("rank 2 runs under torch.autocast('cpu', dtype=torch.bfloat16) but rank 0 runs "
                                  "without autocast: the ranks exchange values in the autocast dtype"), message
        kind, message, seconds = res["mistake_3"]
        assert kind == "PipelineInputError" and seconds < 10, res
        assert message.startswith("rank 3's pipe is in eval mode but rank 0's is in training mode"), message
        kind, message, seconds = res["summed_3"]
        assert kind == "PipelineInputError" and seconds < 10, res
        assert message.startswith("rank 3 called pipe.step with loss_reduction='sum' but rank 0 with 'mean'"), message
        assert max(res["after"]) < 1e-5, (r, res)


def test_a_script_ended_early_is_named_by_its_global_rank_and_error(tmp_path, launch):
    # its end was posted under its pipeline rank, which the other pipeline read as its own: rank 2 was named
    # "rank 3" (alive), and its crash outside the pipe's calls was told as a skipped call
    results = launch("tp_cases:ended_early", 4, "1f1b", tmp_path, limit=120)
    _ok(results)
    for r in (0, 1, 3):
        calls = results[r]["calls"]
        assert [c[0] for c in calls[:2]] == ["returned", "returned"], (r, calls)
        kind, message, seconds = calls[2]
        assert kind == "PeerFailure" and seconds < 15, (r, calls)
        assert "the script of rank 2 after 2 call(s) of this pipe ended while rank" in message, message
        assert "(rank 2 on RuntimeError: crash on rank 2;" in message and "a call skipped" not in message, message
