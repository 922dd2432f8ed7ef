"""The distributed runtime on CPU with gloo: 2 and 3 ranks, every schedule, failures."""

import time

import pytest
from checks import assert_equal_to_eager as _assert_equal_to_eager


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_unet_skip_from_stage_0_to_2(schedule, tmp_path, launch):
    results = launch("unet", 3, schedule, tmp_path)
    _assert_equal_to_eager(results)
    assert any(src == 0 and dst == 2 for _, src, dst in results[0]["skips"])


def test_pipelining_markers_cut_across_ranks(tmp_path, launch):
    results = launch("marked", 3, "1f1b", tmp_path)
    _assert_equal_to_eager(results)
    assert results[0]["firsts"] == ["x", "layers_2", "tanh_3"]  # pipe_split(), then after layers.3


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_tied_embeddings_first_and_last_rank(schedule, world, tmp_path, launch):
    results = launch("tied", world, schedule, tmp_path)
    _assert_equal_to_eager(results)
    assert all(res["summed_error"] < 1e-5 for res in results), results  # loss_reduction="sum", -100 labels
    assert "embed.weight" in results[0]["grad_errors"] and "head.weight" in results[-1]["grad_errors"]
    for res in results:  # the plan says the same of every stage on every rank
        assert res["devices"] == [f"rank {j} (cpu)" for j in range(world)]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("case", ["unet4", "tied4"])
def test_two_stages_per_rank(schedule, case, tmp_path, launch):
    results = launch(case, 2, schedule, tmp_path)
    _assert_equal_to_eager(results)
    ranks = [0, 1, 0, 1] if schedule == "interleaved" else [0, 1, 1, 0]
    for res in results:
        assert res["devices"] == [f"rank {r} (cpu)" for r in ranks]
    if case == "unet4":
        assert [(src, dst) for _, src, dst in results[0]["skips"]] == [(0, 3)]
    else:  # the head (last stage) and the embedding (first) share a weight: one rank under zbv, two otherwise
        assert "embed.weight" in results[0]["grad_errors"]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_sent_tensor_is_let_go_once_its_peer_has_it(schedule, tmp_path, launch):
    # a send's work keeps its tensor alive: held to the end of the step, 8 micro-batches' worth piled up
    results = launch("sends_let_go", 2, schedule, tmp_path)
    _assert_equal_to_eager(results)
    for r, res in enumerate(results):
        assert res["most_held"] <= 4, (r, res["most_held"])


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_sent_gradient_is_not_changed_by_a_later_backward(schedule, tmp_path, launch):
    # the table's .grad shared memory with the gradient sent back: the next micro-batch's backward
    # changed it while gloo sent it (wrong upstream gradients on a loaded machine)
    results = launch("sends_unchanged", 2, schedule, tmp_path)
    _assert_equal_to_eager(results)
    assert [res["changed"] for res in results] == [0, 0]


def test_a_custom_schedule_from_text_runs_across_ranks(tmp_path, launch):
    from schedules import CUSTOM  # stage 0 splits its backward into I and W, stage 1 does not

    results = launch("tied", 2, CUSTOM, tmp_path)
    _assert_equal_to_eager(results)
    rank0 = [line.split("#")[0].split() for line in results[0]["code"].splitlines() if not line.startswith("#")]
    rank1 = [line.split("#")[0].split() for line in results[1]["code"].splitlines() if not line.startswith("#")]
    assert rank0[:3] == [["0F0", "0SEND_F0"], ["0F1", "0SEND_F1"], ["0RECV_B0", "0I0"]]
    assert rank0[-3:] == [["0W0"], ["0W1"], ["0W2"]]
    assert rank1[:2] == [["1RECV_F0", "1F0"], ["1B0", "1SEND_B0"]]


def test_values_of_every_kind_cross_ranks_under_every_schedule(tmp_path, launch):
    # None, numbers, strings, nested dicts and tuples, integer and no-grad tensors, and
    # nn.MultiheadAttention's (out, None), a complex tensor carrying a gradient, cut right
    # after them: pipe(x) and pipe.step; a lazy conjugate (z.conj()) failed its send
    results = launch("values", 2, "all", tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert len(res["cases"]) == 21
        for label, case in res["cases"].items():
            assert case["loss_error"] < 1e-5, (r, label, case)
            assert not case["grad_errors"] or max(case["grad_errors"].values()) < 1e-5, (r, label, case)
            if r == 1:
                assert case["out_error"] < 1e-5 and case["out_rest"], (label, case)


def test_a_channels_last_activation_arrives_channels_last_on_the_next_rank(tmp_path, launch):
    # the cut's value (and the skip h) is NHWC on rank 0; the receive buffers take the spec's layout
    results = launch("channels_last", 2, "all", tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        for schedule, case in res["cases"].items():
            assert case["loss_error"] < 1e-5, (r, schedule, case)
            assert max(case["grad_errors"].values()) < 1e-5, (r, schedule, case)
            if r == 1:
                assert case["seen"] and all(case["seen"]), (schedule, case)


def test_a_new_size_runs_and_another_dtype_or_target_size_is_refused_on_every_rank(tmp_path, launch):
    results = launch("shape", 2, "gpipe", tmp_path)
    for res in results:
        assert res["ok"] and res["resized_error"] < 1e-5, res
        assert res["type"] == "PipelineInputError", res
        # only what differs from the example is named (the dtype: the shape's 4 dimensions are the example's)
        assert ("input 'x' has dtype torch.float64, but the plan was built for dtype torch.float32; sizes may "
                "change from step to step") in res["message"], res["message"]
        assert res["target_rows"] == ("PipelineInputError: target has 3 rows on dim 0 but the inputs have 4; "
                                      "give the target the inputs' batch size"), res
        assert res["after"] == results[0]["after"]
    assert results[1]["later"] == "RuntimeError: broken loss"
    assert "rank 1 (stage 1) raised RuntimeError: broken loss" in results[0]["later"], results[0]["later"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_rank_that_raises_stops_the_others(schedule, tmp_path, launch):
    start = time.monotonic()
    results = launch("raises", 3, schedule, tmp_path, limit=90)
    assert time.monotonic() - start < 45  # well inside the 60 s timeout: failure propagates
    assert results[1]["type"] == "RuntimeError" and "boom in the bomb" in results[1]["message"]
    for r in (0, 2):
        assert results[r]["type"] == "PeerFailure", results[r]
        assert "rank 1 (stage 1) raised RuntimeError: boom in the bomb" in results[r]["message"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])  # fx, export
def test_an_unbatched_input_crosses_ranks_whole(schedule, tmp_path, launch):
    results = launch("unbatched", 2, schedule, tmp_path, limit=90)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5 and res["grad_errors"] and max(res["grad_errors"].values()) < 1e-5, (r, res)
        assert "model input 'pos' requires grad now but did not" in res["refused"], (r, res["refused"])
        assert "example_inputs=(pos.requires_grad_(), ...)" in res["refused"], (r, res["refused"])
    assert max(results[0]["input_grad_errors"]) < 1e-5, results[0]  # routed when it required grad at compile


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])  # fx, export
def test_ranks_that_trace_in_another_order_agree_and_other_graphs_are_refused(schedule, tmp_path, launch):
    # ModernBERT builds its rotary tables iterating a set of strings: the order, and so which node
    # name means which table, follows each process's hash seed. Rank 1 takes rank 0's names.
    for r, res in enumerate(launch("graph_differs", 2, schedule, tmp_path, limit=90)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5 and max(res["grad_errors"].values()) < 1e-5, (r, res)
        kind, message = res["refused"]
        assert kind == "GraphMismatchError", (r, kind, message)
        assert "rank 1 traced another graph of the model than rank 0" in message, message
        assert "computes other values" in message and "PYTHONHASHSEED=0 torchrun" in message, message


def test_a_rank_that_dies_stops_the_others(tmp_path, launch):
    start = time.monotonic()
    results = launch("dies", 3, "1f1b", tmp_path, limit=90)
    assert time.monotonic() - start < 45
    assert results[1] == {"exitcode": 3}
    for r in (0, 2):
        assert results[r]["type"] == "PeerFailure", results[r]
        message = results[r]["message"]  # the first to notice says so; the other reads what it posted
        assert f"rank {r}: communication failed while" in message or f"rank {r} stopped while" in message
        assert "(rank 1 probably died, posting no error)" in message or "because rank 1 died (rank" in message



@pytest.mark.parametrize("mode", ["ddp", "shard"])
def test_parameters_frozen_after_compile_train_as_eager_over_replicas(mode, tmp_path, launch):
    # DDP's reducer waited for the frozen parameters: the others went unaveraged, then DDP raised a step later;
    # FSDP2 left a stage frozen whole unsharded, and fxpipe.save(optimizer=) then refused the optimizer
    results = launch("freeze_cases:frozen_later", 4, "1f1b" + (":shard" if mode == "shard" else ""), tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert max(res["errors"]) < 1e-5, (r, res["errors"])
        assert res["still_sharded"] and res["replaced"] == [], (r, res)


@pytest.mark.parametrize("mode", ["ddp", "shard"])
def test_a_stage_frozen_whole_at_compile_and_unfrozen(mode, tmp_path, launch):
    results = launch("freeze_cases:unfrozen_later", 4, "1f1b" + (":shard" if mode == "shard" else ""), tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        if mode == "ddp":  # wrapped when it needs it: reduced over the replicas
            assert res["refused"] is None and res["error"] < 1e-5, (r, res)
        elif r % 2:  # stage 1's ranks find it; the others hear of it (PeerFailure)
            assert "stage 1 had no parameter requiring grad when the pipe was compiled" in res["refused"], res
            assert "build a new pipe after unfreezing" in res["refused"], (r, res["refused"])
        else:
            assert res["refused"].startswith("PeerFailure"), (r, res["refused"])


# -- pipeline x data parallel (4 gloo ranks: 2 replicas x 2 pipeline ranks) --------------------
def _dp_equal(results, collectives=None):
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5, (r, res["loss_error"])
        assert res["grad_errors"] and max(res["grad_errors"].values()) < 1e-5, (r, res["grad_errors"])
        assert res["norm_error"] < 1e-5 and max(res["clipped_errors"].values()) < 1e-5, (r, res)
        assert max(res["adam_loss_errors"]) < 1e-6, (r, res["adam_loss_errors"])
        if collectives is not None:  # one all-reduce per bucket (one bucket a stage here), not per micro-batch
            assert res["collectives"] == collectives * res["stages"], (r, res["collectives"])


@pytest.mark.parametrize("schedule", ["tied-1f1b", "zb", "tied-interleaved"])
def test_data_parallel_replicate_equals_eager(schedule, tmp_path, launch):
    _dp_equal(launch("dp_train", 4, schedule, tmp_path, limit=180), collectives=1)


@pytest.mark.parametrize("schedule", ["gpipe:shard", "tied-zb:shard"])
def test_data_parallel_fsdp2_equals_eager(schedule, tmp_path, launch):
    _dp_equal(launch("dp_train", 4, schedule, tmp_path, limit=180))


@pytest.mark.parametrize("schedule", ["1f1b-1", "zb-2", "zb:shard-1"])
def test_data_parallel_a_one_row_adaln_table_equals_eager(schedule, tmp_path, launch):
    # with one micro-batch, DDP's reduction wrote the replicas' mean into the table's .grad, which
    # shared memory with the gradient stage 1 then sent back: stage 0's gradients 35-50% off
    for r, res in enumerate(launch("dp_adaln", 4, schedule, tmp_path, limit=120)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5 and max(res["grad_errors"].values()) < 1e-5, (r, res)


def test_data_parallel_fsdp2_warns_of_returned_views_only_at_the_last_stage(tmp_path, launch):
    # stage 0 returns nn.Unflatten's view, which fxpipe only detaches and sends; the last stage's
    # view reaches the user's loss_fn, where FSDP2's warning about in-place ops still holds
    for r, res in enumerate(launch("dp_views", 4, "1f1b:shard", tmp_path, limit=120)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5 and max(res["grad_errors"].values()) < 1e-5, (r, res)
        assert (res["views"] > 0) == (r % 2 == 1), (r, res["views"], res["view_output"])


def test_data_parallel_steps_after_parameters_written_in_place_equal_eager(tmp_path, launch):
    # FSDP2 swaps the sharded and unsharded parameters around a forward: taken for writes, the
    # recomputation put the sharded copies into the unsharded ones, and the second step failed
    for r, res in enumerate(launch("dp_written_then_steps", 4, "1f1b:shard", tmp_path, limit=120)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert max(res["errors"]) < 1e-5, (r, res["errors"])


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b:shard"])
def test_data_parallel_accumulation_and_autocast(schedule, tmp_path, launch):
    for r, res in enumerate(launch("dp_accumulate", 4, schedule, tmp_path, limit=180)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert max(res["grad_errors"].values()) < 1e-5, (r, res["grad_errors"])
        assert res["autocast_loss_error"] < 1e-5 and max(res["autocast_grad_errors"].values()) < 1e-5, (r, res)
        assert res["bf16_vs_fp32"] > 1e-4  # autocast really ran (bf16 differs from float32)


def test_data_parallel_refusals(tmp_path, launch):
    for r, res in enumerate(launch("dp_refusals", 4, "gpipe", tmp_path, limit=120)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert "world 4 cannot hold 2 pipeline ranks x 3 replicas" in res["layout"]
        assert res["batch"].startswith("PipelineInputError"), res["batch"]
        assert "replica 1 has a batch of 3 rows but replica 0 has 4" in res["batch"] or \
            "replica 0 has a batch of 4 rows but replica 1 has 3" in res["batch"]
        assert res["eval_batch"].startswith("PipelineInputError") and "pad the short batch" in res["eval_batch"] \
            and "gradients" not in res["eval_batch"], res["eval_batch"]
        for label in ("inputs", "target"):  # replica 0 refused it too, instead of failing in gloo
            assert res[label].startswith("PipelineInputError"), (r, label, res[label])
            if r < 2:
                assert "replica 1 refused this step" in res[label], (r, label, res[label])
        assert "pipe.step got no inputs on rank 2" in res["inputs"]
        assert "target=None on rank 3, which computes the loss" in res["target"]
        assert "is used by stages 0 and 3, which run on one rank" in res["tie"], (r, res)  # every rank, not 0 and 2
        # sparse gradients FSDP2 / DDP over an exported graph cannot reduce (torch failed in the first step)
        assert "sparse=True, whose sparse gradient FSDP2 cannot reduce-scatter" in res["sparse shard"], (r, res)
        assert "tracer='fx'" in res["sparse export"] and "Cannot access storage" in res["sparse export"], (r, res)
        assert any("replicas' weights drift apart" in w for w in res["max_norm"]), (r, res)
        assert "is not contiguous (channels_last), which FSDP2 cannot shard" in res["channels_last shard"], (r, res)
        assert "stage 1 holds parameters of several dtypes, torch.float32 ('2.weight'), torch.float64 ('3.head.weight')" \
            in res["mixed dtypes shard"] and "data_parallel_shard=False" in res["mixed dtypes shard"], (r, res)


def test_data_parallel_reduces_the_gradients_of_a_model_cast_after_compile(tmp_path, launch):
    # DDP's reducer, built for float32 parameters, left their float64 gradients unreduced: 0.008-0.075 off, silently
    for r, res in enumerate(launch("dp_cast", 4, "1f1b", tmp_path, limit=120)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert max(res["grad_errors"].values()) < 1e-5, (r, res["grad_errors"])


def test_fsdp2_refuses_a_model_cast_after_its_first_step_naming_the_fix(tmp_path, launch):
    # FSDP2 kept the float32 parameters it gathered: "mat1 and mat2 must have the same dtype" inside a stage
    for r, res in enumerate(launch("dp_cast", 4, "1f1b:shard", tmp_path, limit=120)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["refused"] is not None and "a model cast after compile" in res["refused"] \
            and "cast the model before fxpipe.compile" in res["refused"], (r, res["refused"])


@pytest.mark.parametrize("schedule", ["1f1b:deferred", "zb:plain:shard", "zb:deferred:export", "1f1b:deferred:subclass"])
def test_data_parallel_keeps_batch_norm_statistics_equal_over_replicas(schedule, tmp_path, launch):
    # DDP broadcasts buffers in its forward, which the pipeline never calls, and FSDP2 leaves them alone:
    # each replica's running statistics drifted to its own share of the batch
    results = launch("dp_batch_norm", 4, schedule, tmp_path, limit=120)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["stats"] and res["stats"] == results[r % 2]["stats"], f"rank {r} differs from replica 0"
        # a full state dict loads into each rank's own tensors, FSDP2's shards too (a raw DTensor error before),
        # without torch's warnings for the batch norms other ranks hold
        assert res["loaded"] and all(res["loaded"].values()), (r, res["loaded"])
        assert not [w for w in res["load_warnings"] if "meta parameter" in w], (r, res["load_warnings"])
        if schedule.endswith("deferred"):  # the global batch's statistics
            assert max(res["errors"].values()) < 1e-5, (r, res["errors"])


def test_loss_scaling_skips_the_same_steps_on_every_rank(tmp_path, launch):
    results = launch("scaler", 2, "zb", tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["type"] == "ShardedGradScaler" and res["skipped"] and res["scale"] == 512.0, (r, res)
        # torch.amp.GradScaler let each rank skip alone: the ranks' scales then parted (65536 against 32768)
        assert res["plain"].startswith("scaler= is a GradScaler, whose inf/NaN check each rank makes alone"), res
        assert "fxpipe.grad_scaler(pipe)" in res["plain"]
    assert results[0]["loss"] == results[1]["loss"] < 10  # unscaled, the same on both ranks


def test_tied_gradients_accumulate_over_steps_like_eager(tmp_path, launch):
    results = launch("tie_cases:accumulate", 2, "1f1b", tmp_path, limit=60)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["tied_here"] > 0, r
        assert res["refused"], r
        for when in ("two_steps", "no_sync_then_synced", "after_zero_grad", "after_refused", "frozen_tie_others"):
            assert res[when] < 1e-5, (r, when, res[when])
        assert res["frozen_tie_grads"] == [], (r, res["frozen_tie_grads"])  # frozen: None, as eager's


def test_a_no_sync_step_under_fsdp2_with_a_tie_across_ranks_accumulates(tmp_path, launch):
    # the no_sync step left FSDP2's gathered parameters on the stages, the model's root kept its shard, and the next
    # step's forward mixed them: "aten.add.Tensor got mixed torch.Tensor and DTensor"
    for r, res in enumerate(launch("tie_cases:accumulate_sharded", 4, "1f1b", tmp_path)):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert len(res["errors"]) == 2 and max(res["errors"]) < 1e-5, (r, res["errors"])


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_sparse_embedding_read_on_two_ranks_sums_its_sparse_gradient_like_eager(tmp_path, launch, schedule):
    results = launch("tie_cases:sparse", 2, schedule, tmp_path, limit=60)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["tied_here"] > 0, r
        assert res["sparse_grad_1"] and res["sparse_grad_2"], (r, res)  # SparseAdam takes it
        for key in ("grads_1", "grads_2", "params", "norm"):
            assert res[key] < 1e-5, (r, key, res[key])


def test_a_tie_no_loss_reaches_keeps_its_gradient_none_like_eager(tmp_path, launch):
    results = launch("tie_cases:unreached", 2, "1f1b", tmp_path, limit=60)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["tied_here"] > 0, r
        assert res["critic_eager_none"] == ["actor.bias", "actor.weight"], res
        for name in ("actor.weight", "actor.bias"):
            assert res["critic"][name] == "None", (r, res["critic"])  # zeros moved it under Adam
            assert res["actor"][name] < 1e-5, (r, res["actor"])
        assert all(e < 1e-5 for n, e in res["critic"].items() if not n.startswith("actor")), (r, res)


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_dataclass_records_cross_ranks_and_come_back_as_records(schedule, tmp_path, launch):
    # before: the first rank's gradients 3x too small (gpipe), and pipe(x) refused on the last rank only
    results = launch("record_cases:records", 2, schedule, tmp_path)
    for res in results:
        assert res["loss"] < 1e-5 and res["grads"] < 1e-5, res
    assert results[0]["out"] is None and results[1]["out"][0] == "Out" and results[1]["out"][1] < 1e-5


def test_an_output_no_row_changes_is_taken_from_one_micro_batch_across_ranks(tmp_path, launch):
    # a learned temperature returned beside the logits: pipe(x) refused it as a 0-dim output that "each
    # micro-batch computes over its own rows"
    results = launch("record_cases:independent", 2, "1f1b", tmp_path)
    for res in results:
        assert res["loss"] < 1e-5 and res["grads"] < 1e-5, res
    assert results[0]["out"] is None and max(results[1]["out"]) < 1e-6, results


def test_a_float64_model_s_gradient_norm_is_eager_s_in_float64_on_every_rank(tmp_path, launch):
    # the norm was reduced in float32 across ranks: 6.5e-9 off eager's, and clipped runs drifted at 1e-7
    for res in launch("dist_cases:clip_float64", 2, "1f1b", tmp_path):
        assert res["dtype"] == "torch.float64" and res["error"] < 1e-14, res


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b:frozen"])
def test_every_order_of_gradient_norm_is_eager_s_across_ranks(schedule, tmp_path, launch):
    # -inf summed the ranks' minima raised to -inf (1.0 for eager's 9e-5) and 0 divided by zero; a rank holding no
    # gradient added 0 ** -1 (inf) to a negative order's sum: the norm came back 0
    for res in launch("dist_cases:clip_orders", 2, schedule, tmp_path):
        res.pop("ok", None)
        assert all(err < 1e-12 for err in res.values()), res


def test_ranks_that_built_other_weights_are_warned_at_compile(tmp_path, launch):
    # torch.manual_seed(base + rank) before building: each rank kept its own stages' weights from its own model,
    # and the pipe ran a mix no rank built (loss 1.626 for rank 0's model's 1.655), silently
    for res in launch("dist_cases:seeded_per_rank", 2, "1f1b", tmp_path):
        assert res["per_rank"] and "Seed every rank alike before building the model" in res["per_rank"][0], res
        assert not res["alike"], res


def test_a_rank_whose_loop_fell_out_of_step_is_refused_at_that_step(tmp_path, launch):
    # the batches were compared at the first step only: a loader one batch shorter on one rank trained the first
    # rank's inputs against another batch's target (loss 6% off), silently
    res = launch("dist_cases:loop_out_of_step", 2, "1f1b", tmp_path)
    assert res[1]["raised"].startswith("PipelineInputError: rank 1 was given other inputs than rank 0"), res
    assert "out of step" in res[0]["raised"], res


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_one_batch_whose_target_loss_fn_masks_in_place_is_not_called_out_of_step(schedule, tmp_path, launch):
    # the last rank's target, written by loss_fn, was compared with the first's at the next step: refused as "out of
    # step" (under ZB-V the first rank's own, written, was sent to the others); and a rank given the loader's whole
    # tuple (more inputs than the model takes) raised a bare TypeError
    for res in launch("dist_cases:same_batch_target_masked", 2, schedule, tmp_path):
        assert not res["raised"], res
        assert len(res["errors"]) == 3 and max(res["errors"]) < 1e-12, res


def test_meta_placeholders_on_ranks_that_do_not_read_them_run(tmp_path, launch):
    # inputs on meta past the first rank and a target on meta before the last were refused on every rank (the meta
    # refusal looked at what each rank was given, not at what it reads); a meta target where the loss is computed is
    first, last = launch("dist_cases:meta_placeholders", 2, "1f1b", tmp_path)
    assert first["error"] < 1e-6 and last["error"] < 1e-6 and last["out"] < 1e-6, (first, last)
    assert "target is on the meta device" in last["raised"], (first, last)
    # told in the step's first messages (it was a failed step, the first rank's PeerFailure)
    assert "PipelineInputError: rank 1 (the loss's): target is on the meta device" in first["raised"], (first, last)


def test_pipe_call_in_training_with_grad_on_says_it_runs_forwards_only(tmp_path, launch):
    # the last rank's loss.backward() on pipe(x)'s output raised torch's "element 0 of tensors does not require grad"
    for res in launch("dist_cases:forward_to_train", 2, "1f1b", tmp_path):
        first, second, no_grad = res["told"]
        assert len(first) == 1 and "pipe(x) across ranks runs forwards only" in first[0] and "pipe.step" in first[0]
        assert second == [] and no_grad == [], res


def test_a_loss_reduction_other_than_the_first_rank_s_is_refused(tmp_path, launch):
    # rank 0 passed 'sum' (as its summed loss_fn needs), the loss's rank 'mean': gradients 0.25x eager's, silently
    res = launch("dist_cases:reductions_differ", 2, "1f1b", tmp_path)
    assert res[1]["raised"].startswith("PipelineInputError: rank 1 called pipe.step with loss_reduction='mean' but "
                                       "rank 0 (the first stage's) with 'sum'"), res
    assert "loss_reduction='mean'" in res[0]["raised"], res
    assert all(r["error"] < 1e-5 for r in res), res
    # replicas: each pipeline agreed with itself; replica 1's gradients were averaged in at 0.25x, silently
    res = launch("dist_cases:reductions_differ", 4, "1f1b:dp", tmp_path)
    assert all("but replica" in r["raised"] and "loss_reduction=" in r["raised"] for r in res), res
    assert all(r["error"] < 1e-5 for r in res), res


def test_a_nan_buffer_alike_on_every_rank_is_not_warned_as_other_weights(tmp_path, launch):
    # NaN != NaN: a buffer every rank built as NaN was warned as "built the model with other weights"
    for res in launch("dist_cases:nan_buffer_alike", 2, "1f1b", tmp_path):
        assert not res["told"], res


def test_a_nan_gradient_on_one_rank_makes_the_inf_norm_nan_on_every_rank(tmp_path, launch):
    # the ranks' max dropped the NaN (gloo kept the other rank's number): error_if_nonfinite let NaN gradients step
    for res in launch("dist_cases:clip_nan", 2, "1f1b", tmp_path):
        assert res["nan"] and res["refused"], res


@pytest.mark.parametrize("world, schedule", [(3, "1f1b"), (3, "zb"), (2, "zbv"), (4, "1f1b:ddp")])
def test_parameters_only_an_ignored_output_reads_keep_no_gradient(world, schedule, tmp_path, launch):
    # a parameter read early by an output the loss ignores got zeros through the skip (AdamW then decayed it),
    # and under DDP one read late left the reducer waiting: "Expected to mark a variable ready only once"
    results = launch("unreached_cases:ignored", world, schedule, tmp_path)
    for r, res in enumerate(results):
        assert res["errors"] and max(res["errors"]) < 1e-5, (r, res)
        assert all(pipe_none and eager_none for _, pipe_none, eager_none in res["nones"]), (r, res["nones"])
    assert {n for res in results for n, _, _ in res["nones"]} == {"scale", "tail"}


def test_replicas_whose_losses_reach_different_parameters_average_like_eager(tmp_path, launch):
    # the after-step reduction flattened only each replica's own gradients: sizes differed (gloo aborted the
    # process) or, equal in size, one replica's head gradient was added to another's other head, silently
    results = launch("unreached_cases:disagreeing", 4, "1f1b", tmp_path)
    for r, res in enumerate(results):
        assert res["replicas"] == 2 and res["errors"] and max(res["errors"].values()) < 1e-5, (r, res)
        assert all(pipe_none and eager_none for _, pipe_none, eager_none in res["nones"]), (r, res["nones"])
    assert {n for res in results for n in res["errors"]} >= {"scale", "tail"}  # only replica 0's loss reads them


def test_replicas_whose_data_skips_other_experts_of_a_leaf_average_like_eager(tmp_path, launch):
    # DDP waited for the experts a replica's rows skipped: gradients 2.8x off at the first step, silently, and
    # torch's "mark a variable ready only once" at the second; a leaf of the user's is reduced after the step (one
    # holding its experts' weights itself was not seen as such: 1.37x off, silently)
    results = launch("unreached_cases:skipped_experts", 4, "1f1b", tmp_path)
    results += launch("unreached_cases:skipped_experts_sharded", 4, "1f1b", tmp_path)  # FSDP2: 1.3x off, or aborted
    for r, res in enumerate(results):
        assert res.get("replicas") == 2 and max(res["errors"]) < 1e-10, (r, res)


@pytest.mark.parametrize("world, schedule", [(2, "1f1b"), (2, "zbv"), (3, "gpipe")])
def test_a_buffer_bumped_on_one_rank_reaches_a_later_rank_as_each_micro_batch_saw_it(world, schedule, tmp_path,
                                                                                      launch):
    # before: the last stage's rank read its own copy of the step counter, which nothing bumped (and in one
    # process the live one, bumped by every micro-batch already): gradients 41% off, silently
    results = launch("buffer_cases:counted", world, schedule, tmp_path)
    for r, res in enumerate(results):
        assert max(res["errors"], default=0.0) < 1e-5, (r, res)
        assert all(e < 1e-6 for e in res["losses"]), (r, res)
        assert [name for name, _, _ in res["skips"]] in ([], ["step_as_written"]), res["skips"]
    assert sum(len(res["errors"]) for res in results) == 8 and any(res["losses"] for res in results)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_sparse_buffer_compiles_and_trains_on_two_ranks(schedule, tmp_path, launch):
    # compile's check that the ranks built the same weights reshaped every float buffer: "reshape is not
    # implemented for sparse tensors" on every rank, naming nothing
    results = launch("buffer_cases:sparse_buffer", 2, schedule, tmp_path)
    for r, res in enumerate(results):
        assert res["ok"], (r, res)
        assert max(res["errors"]) < 1e-5 and max(res["losses"]) < 1e-6, (r, res)


def test_a_distributed_pipe_is_not_copied_and_the_message_names_averaging_the_model(tmp_path, launch):
    # copy.deepcopy(pipe) and AveragedModel(pipe) raised "cannot pickle 'ProcessGroup' object", naming no fix
    for res in launch("copied", 2, "1f1b", tmp_path):
        assert "a distributed pipe cannot be copied" in res["refused"] and "AveragedModel(model)" in res["refused"]
        assert res["averaged"], res


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_an_auxiliary_head_returned_in_training_only_and_ignored_trains_under_ddp(schedule, tmp_path, launch):
    # GoogLeNet's namedtuple of (logits, aux) built under `if self.training:` was one output node to the gradient
    # reach, so the aux head was wrapped by DDP: the first step's last-stage gradients were not averaged, and
    # the second raised DDP's "Expected to mark a variable ready only once"
    results = launch("unreached_cases:auxiliary", 4, schedule, tmp_path)
    for r, res in enumerate(results):
        assert max(res["errors"].values(), default=0.0) < 1e-5, (r, res)
        assert res["unused"][1] == ["aux", "head"], res
    assert {n for res in results for n in res["nones"]} == {"aux.weight", "aux.bias"}


def _by_held_names(results, key):
    """Group the ranks' results by the names of the tensors they hold under ``key`` (one group per stage)."""
    groups = {}
    for res in results:
        groups.setdefault(tuple(sorted(res[key])), []).append(res)
    return groups


@pytest.mark.parametrize("schedule", ["1f1b:fx", "1f1b:export"])
def test_batch_norms_called_as_functions_keep_the_first_replica_s_statistics(schedule, tmp_path, launch):
    # a batch norm subclass fx traced through (timm's BatchNormAct2d), or any exported one, leaves the stage no
    # batch norm module: its statistics were not copied from the first replica, and the replicas drifted apart;
    # then copied in each process's string-hash order, into other norms' buffers (each rank has its own seed)
    results = launch("dist_cases:replica_norms", 4, schedule, tmp_path)
    assert all(res["ok"] for res in results), [res.get("message") for res in results]
    by_stage = _by_held_names(results, "stats")
    assert len(by_stage) == 2, by_stage.keys()
    for names, pair in by_stage.items():
        assert names and len(pair) == 2 and {r["replica"] for r in pair} == {0, 1}, names
        assert pair[0]["stats"] == pair[1]["stats"], names


@pytest.mark.parametrize("schedule", ["1f1b:fx", "zb:export"])
def test_buffers_a_forward_writes_keep_the_first_replica_s_values(schedule, tmp_path, launch):
    # a MoCo queue of keys enqueued in the forward: each replica kept its own (checksums 13.0 and 11.0 after 3 steps),
    # where DDP's broadcast_buffers=True copies the first replica's before every forward
    results = launch("dist_cases:replica_written_buffers", 4, schedule, tmp_path)
    assert all(res["ok"] for res in results), [res.get("message") for res in results]
    by_stage = _by_held_names(results, "held")
    written = [pair for names, pair in by_stage.items() if "queue" in names]
    assert written and all(len(pair) == 2 and {r["replica"] for r in pair} == {0, 1} for pair in written), by_stage
    for pair in written:
        assert pair[0]["held"] == pair[1]["held"] and any(v != 0 for v in pair[0]["held"]["queue"][0]), pair
        assert any(v != 0 for v in pair[0]["held"]["centre"]), pair  # a frozen parameter written: 0.063 apart
    # FSDP2 gathers the parameters for each forward: the write went to a copy, and the recomputation segfaulted
    assert all("writes the parameter(s) centre in place" in res["sharded"] for res in results), results


def test_a_value_sized_by_the_inputs_values_is_kept_on_one_rank_and_refused_across_ranks(tmp_path, launch):
    # across ranks a receiver sizes buffers from the shapes, and a packed sequence's size follows its lengths'
    # values: the specs resized for the micro-batch sent garbage batch sizes (an LSTM read 4.6e18 steps); rows a
    # mask picks (x[x[:, 0] > 0]) were read from memory never written: a loss of inf, silently
    results = launch("dist_cases:packed_sequences", 2, "1f1b", tmp_path)
    for res in results:
        assert "head" in res and res["head"] < 1e-5, res  # cut after the unpacking: specs resized by the rows
        assert res["scattered"] < 1e-5, res  # nonzero inside stage 0, its rows put back: not refused
        assert res["scattered_one"] < 1e-5, res  # and with one micro-batch
        kind, message = res["quantized"]
        assert kind == "PipelineInputError" and "'0', '2' are quantized module(s)" in message \
            and "run in one process only" in message, message
        kind, message = res["generator_full_like"]  # drawn from a copy of rank 0's generator: the same numbers each step
        assert kind == "PipelineInputError" and "input 'gen' is a torch.Generator, read by stage 1 on rank 1" \
            in message and "self.gen = torch.Generator()" in message, message
        assert res["generator_b"] < 1e-5, res  # read on the first stage's rank: replayed in recomputation
        kind, message = res["pooled"]  # one micro-batch: not checked, and a later step's graph count failed in gloo
        assert kind == "PipelineInputError" and "'index_add_' is sent from stage 0 (rank 0) to stage 1 (rank 1), " \
            "and fxpipe cannot tell its size from the inputs' shapes: it follows their values" in message, message
        kind, message = res["masked"]
        assert kind == "PipelineInputError" and "it follows their values" in message, message
        kind, message = res["rnn2"]
        assert kind == "PipelineInputError" and "is sent from stage 0 (rank 0) to stage 1 (rank 1), and fxpipe " \
            "cannot tell its size" in message, message


def test_inference_under_no_grad_through_a_nested_tensor_fast_path_equals_eager(tmp_path, launch):
    # nn.TransformerEncoder with a padding mask under no_grad makes nested tensors, which the layout's propagation
    # on fake tensors cannot: every rank refused the call ("NestedTensorImpl doesn't support sizes")
    results = launch("dist_cases:nested_fast_path", 2, "1f1b", tmp_path)
    assert results[0]["error"] is None and results[1]["error"] == 0.0, results


def test_a_port_taken_before_rank_0_binds_it_is_retried_on_a_new_one(tmp_path, monkeypatch):
    # the launcher's own robustness: another test's connection can take the store's port between
    # choosing it and rank 0 binding it (EADDRINUSE); the case then runs again on another port
    import socket

    import launch as launcher

    taken = socket.socket()  # bound, not listening: as an outgoing connection holds its port
    taken.bind(("127.0.0.1", 0))
    ports = iter([taken.getsockname()[1]])
    fresh = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or fresh())
    try:
        results = launcher.launch("tied", 2, "1f1b", tmp_path)
    finally:
        taken.close()
    _assert_equal_to_eager(results)
