"""What long training runs meet, across 2 and 4 gloo ranks: new sizes, failed steps, misuse, resumes."""

import pytest


def _ok(results):
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"


def _refused(res, label, rank):
    """Return the message of the refusal a rank recorded under ``label``, asserting it came within seconds."""
    kind, message, seconds = res[label]
    assert kind == "PipelineInputError" and seconds < 5, (rank, label, res)
    return message


@pytest.mark.parametrize("schedule,world", [("1f1b", 2), ("zb", 2), ("interleaved", 2), ("1f1b", 4)])
def test_sequence_lengths_change_from_step_to_step(schedule, world, tmp_path, launch):
    results = launch("longrun_cases:seqlens", world, schedule, tmp_path)
    _ok(results)
    for res in results:
        for loss_error, grad_error in res["errors"]:  # lengths 16, 24, 8, 24
            assert loss_error < 1e-5 and grad_error < 1e-5, res["errors"]


@pytest.mark.parametrize("schedule,world", [("interleaved", 2), ("zbv", 2), ("zbv", 4)])
def test_a_batch_of_fewer_rows_than_ranks_runs_under_several_stages_per_rank(schedule, world, tmp_path, launch):
    # a DataLoader's last batch of 1 row was refused under interleaved and zbv ("needs at least 2 micro-batches")
    results = launch("longrun_cases:small_batches", world, schedule, tmp_path)
    _ok(results)
    for res in results:
        for loss_error, grad_error in res["errors"]:  # 8, 1, 3 and 8 rows
            assert loss_error < 1e-5 and grad_error < 1e-5, res["errors"]


def test_layouts_dropped_from_a_bounded_cache_come_back_equal(tmp_path, launch):
    # every new sequence length's specs were kept for ever: a job padding to each batch's length grew
    # each rank's memory without bound (17 MB over 300 lengths on a tiny decoder)
    results = launch("longrun_cases:seqlens_few_kept", 2, "1f1b", tmp_path)
    _ok(results)
    for rank, res in enumerate(results):
        assert res["kept"] == 2 - rank
        for loss_error, grad_error in res["errors"]:
            assert loss_error < 1e-5 and grad_error < 1e-5, res["errors"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_an_inference_call_failing_after_the_first_rank_moved_on_leaves_the_steps_paired(schedule, tmp_path, launch):
    # the first rank's pipe(x) returned, its next step met the failure and raised, and every later step paired its
    # inputs with the last rank's previous target (parameters 3e-2 off after 3 steps, silently)
    results = launch("longrun_cases:late_inference_failure", 2, schedule, tmp_path)
    _ok(results)
    assert results[1]["failed"][:2] == ["RuntimeError", "bomb in forward"], results[1]
    for r, res in enumerate(results):
        assert max(res["errors"]) < 1e-5, (r, res)


def test_a_middle_rank_two_calls_past_a_failed_inference_call_runs_the_later_one_again(tmp_path, launch):
    # 4 ranks: rank 1 finished the good pipe(x) after the failing one before the failure reached it; its step then
    # paired with the others' run of that pipe(x) again, and every later call said "rank 1 probably died"
    results = launch("longrun_cases:late_failure_then_evaluation", 4, "gpipe", tmp_path)
    _ok(results)
    assert results[3]["failed"][:2] == ["RuntimeError", "bomb in forward"] and results[3]["evaluated"] < 1e-6
    for r, res in enumerate(results):
        assert max(res["errors"]) < 1e-5, (r, res)


@pytest.mark.parametrize("schedule,world", [("1f1b", 2), ("zb", 4)])
def test_a_failed_step_leaves_the_pipe_usable(schedule, world, tmp_path, launch):
    results = launch("longrun_cases:recover", world, schedule, tmp_path)
    _ok(results)
    last = world - 1
    for r, res in enumerate(results):
        kind, message, seconds = res["failed"]
        assert seconds < 10, (r, seconds)  # told at once, not after the 60 s timeout
        if r == last:
            assert (kind, message) == ("RuntimeError", "broken loss")
        else:
            assert kind == "PeerFailure"
            assert f"because rank {last} (stage {last}) raised RuntimeError: broken loss" in message
        assert res["refused"][0] == "PipelineInputError"
        assert res["refused"][1].startswith("the inputs cannot run through the model: node ")
        # loss_fn=None on rank 0 alone: raised before its step, it left the others to pair their step with
        # its next call (its inputs against their target), silently
        kind, message, seconds = res["no_loss_fn"]
        assert seconds < 10 and "loss_fn must be a function (output, target) -> loss, got NoneType" in message, res
        assert kind == "TypeError", (r, kind)  # told in the step's layout: refused on every rank, none reconnects
        for label in ("before", "after", "again"):
            assert max(res[label]) < 1e-5, (r, label, res[label])


def test_zbv_target_only_on_the_highest_rank_is_refused_on_every_rank(tmp_path, launch):
    # under ZB-V rank 0 computes the loss; a target on the highest rank only once reached loss_fn as None there
    results = launch("longrun_cases:misuse_zbv", 2, "zbv", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        message = _refused(res, "target_on_highest", r)
        assert "target=None on rank 0, which computes the loss (it holds the first and the last stage), but a " \
               "target on rank 1: pass the target on rank 0" in message
        kind, message, seconds = res["forward_without_inputs"]
        assert kind == "PipelineInputError" and message.startswith("pipe(...) got no inputs on rank 0"), (r, res)
        assert "the output comes back on rank 0" in message
        assert max(res["after"]) < 1e-5, (r, res["after"])


@pytest.mark.parametrize("schedule,world", [("1f1b", 4), ("zbv", 2), ("interleaved", 2)])
def test_step_arguments_left_out_are_refused_on_every_rank_and_the_pipe_steps_on(schedule, world, tmp_path, launch):
    # target= or loss_fn= left out was raised on the rank before its step and told as a failed step: every
    # rank reconnected, and under data parallel (4 ranks) the pipe refused every later step ("restart the job");
    # so did a step under torch.no_grad(), refused inside the step
    results = launch("longrun_cases:argument_refusals", world, schedule, tmp_path, limit=90)
    _ok(results)
    last = 0 if schedule == "zbv" else 1
    for r, res in enumerate(results):
        labels = ["first", "later"] + (["one_replica"] if world == 4 else [])
        for label in labels:
            kind, message, seconds = res[label]
            assert seconds < 5, (r, label, res[label])
            if label == "one_replica" and r < 2:
                assert kind == "PipelineInputError" and "replica 1 refused this step" in message, (r, res[label])
            elif r % 2 == last and (label != "one_replica" or r == 3):
                assert kind == "TypeError" and message.startswith("pipe.step() needs target="), (r, res[label])
            else:  # told: the same kind on every rank (the first step's was a PipelineInputError elsewhere)
                assert kind == "TypeError" and "needs target=: the batch's target, or target=None" in message, \
                    (r, label, res[label])
        kind, message, _ = res["no_loss_fn"]
        assert kind == "TypeError" and "pipe.step() needs loss_fn=" in message, (r, res["no_loss_fn"])
        if world == 4:
            kind, message, _ = res["string"]
            assert kind == "PipelineInputError" and "replica 1's inputs hold no tensor with a batch dim" in message
        kind, message, _ = res["no_grad"]
        assert kind == "RuntimeError" and "pipe.step runs backward and needs autograd" in message, (r, res["no_grad"])
        assert res["loss_error"] < 1e-5 and res["grad_error"] < 1e-5, (r, res)
    assert len({round(res["good"], 6) for res in results}) == 1


def test_a_loss_rank_in_another_mode_autocast_or_reduction_is_refused_on_every_rank_and_steps_on(tmp_path, launch):
    results = launch("longrun_cases:state_mismatch", 4, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        for label, told in [("eval", "rank 1's pipe is in eval mode but rank 0's (the first stage's) is in training"),
                            ("autocast", "rank 3 runs under torch.autocast('cpu', dtype=torch.bfloat16) but rank 2"),
                            ("reduction", "rank 3 called pipe.step with loss_reduction='sum' but rank 2")]:
            message = _refused(res, label, r)
            assert told in message, (r, label, message)
        assert max(res["after"]) < 1e-5, (r, res["after"])


def test_a_middle_rank_refusing_at_the_first_step_fails_it_and_the_next_steps_equal_eager(tmp_path, launch):
    results = launch("longrun_cases:middle_refusal_first", 3, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        kind, message, seconds = res["failed"]
        assert kind == ("TypeError" if r == 1 else "PeerFailure") and seconds < 5, (r, res["failed"])
        assert "pipe.step() needs loss_fn=" in message
        assert max(max(e) for e in res["after"]) < 1e-5, (r, res["after"])


def test_a_parameter_unfrozen_after_compile_is_refused_and_data_parallel_steps_on(tmp_path, launch):
    # refused inside the step, it was a failed step: under data parallel every later call refused ("restart")
    results = launch("longrun_cases:unfrozen_under_dp", 4, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        kind, message, seconds = res["unfrozen"]
        assert kind == "PipelineInputError" and seconds < 5, (r, res["unfrozen"])
        assert "parameter '0.0.weight' (stage 0) requires grad now but did not when the pipe was compiled" in message
        assert res["after"] < 1e-5 and res["grads"] < 1e-5, (r, res)


@pytest.mark.parametrize("world", [2, 4])
def test_inputs_or_target_on_the_wrong_rank_are_refused_on_every_rank(world, tmp_path, launch):
    results = launch("longrun_cases:misuse", world, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        message = _refused(res, "target_on_first", r)
        if world == 2:
            assert "target=None on rank 1, which computes the loss: pass the target on rank 1 (the last " \
                   "stage)" in message
        else:
            assert "pass the target on ranks 1, 3 (the last stage in each of the 2 replicas)" in message
        first = "rank 0 (the first stage)" if world == 2 else "ranks 0, 2 (the first stage in each of the 2 replicas)"
        for label in ("inputs_on_last", "keywords_on_last"):
            message = _refused(res, label, r)
            assert f"which splits them into micro-batches: pass the inputs on {first}" in message, (label, message)
        if world == 2:
            assert max(res["after"]) < 1e-5
        else:
            assert res["after"] == results[0]["after"]  # the global batch's loss on every rank
        # a later step: refused on every rank before anything ran (the loss's rank alone refused it, the others
        # failed in their sends, and under data parallel every later step was refused)
        message = _refused(res, "target_on_first_later", r)
        assert "target=None on rank 1, which computes the loss: pass the target on rank 1" in message if world == 2 \
            else ("which computes the loss" in message or "refused this step" in message), (r, message)
        assert res["recovered"] == results[0]["recovered"], (r, res)


@pytest.mark.parametrize("world", [2, 4])
def test_a_bad_target_on_the_loss_rank_alone_is_refused_on_every_rank_and_the_pipe_steps_on(world, tmp_path, launch):
    # it was met only when the loss was computed: under data parallel the other replica then waited in its
    # reduction past timeout=, and the pipe was dead for every later step
    results = launch("longrun_cases:target_on_loss_rank_only", world, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        message = _refused(res, "short_target", r)
        assert "target has 3 rows on dim 0 but the inputs have 8" in message, (r, message)
        if world == 2:  # the two sizes were given on two ranks: both are named
            assert ("the inputs have 8 (the target given on rank 1, the loss's; the inputs on rank 0, the first "
                    "stage's); give the target the inputs' batch size") in message, (r, message)
        if world == 4:
            message = _refused(res, "missing_on_one_replica", r)
            assert ("target=None on rank 3, which computes replica 1's loss, but a target on replica 0's"
                    if r in (2, 3) else "replica 1 refused this step") in message, (r, message)
    losses = {round(res["after"], 6) for res in results if res["after"]}
    assert len(losses) == 1, results  # the step after the refusals ran, with one loss wherever it is returned


def test_a_replica_waiting_on_a_failed_peer_gives_up_after_timeout(tmp_path, launch):
    # the replicas' groups came from init_device_mesh with torch's default 30-minute timeout: rank 1 waited in
    # its gradient reduction until rank 3's process exited
    results = launch("longrun_cases:replica_peer_stuck", 4, "1f1b", tmp_path, limit=90)
    _ok(results)
    kind, _, seconds = results[1]["failed"]
    assert kind == "PeerFailure" and seconds < 10, results[1]
    assert results[3]["failed"][0] == "RuntimeError"


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_forward_whose_outputs_cannot_be_joined_is_refused_on_every_rank_in_the_same_call(schedule, tmp_path, launch):
    # found on the last rank after the forwards, the refusal reached the first rank a call late,
    # and every later call paired with the wrong one (a Hugging Face model's loss from labels=)
    results = launch("longrun_cases:unjoinable_forward", 2, schedule, tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        for label in ("first", "again"):
            message = _refused(res, label, r)
            assert "returns a 0-dim tensor (['loss']), which cannot be joined across 2 micro-batches" in message
            assert "out.loss" in message, message
        error, seconds = res["step"]
        assert error < 1e-6 and seconds < 10, (r, res)


def test_labels_given_to_the_first_rank_only_are_looked_at_there(tmp_path, launch):
    # the rank computing the loss had no labels=, so no rank warned of the -100 shares (gradients 1.2 off, silently)
    results = launch("longrun_cases:labels_on_the_first_rank", 2, "1f1b", tmp_path, limit=60)
    _ok(results)
    assert results[0]["warned"] and results[0]["warned"][0].startswith("labels marks entries -100"), results
    assert not results[1]["warned"]  # said once, by the rank that has them


def test_the_loss_comes_back_in_its_dtype_on_every_rank(tmp_path, launch):
    # the ranks that do not compute the loss got it as a float32 tensor of the float64 loss's value
    results = launch("longrun_cases:loss_dtype", 2, "1f1b", tmp_path, limit=60)
    _ok(results)
    assert [res["dtype"] for res in results] == ["torch.float64"] * 2
    assert results[0]["value"] == results[1]["value"] == pytest.approx(results[0]["expected"], rel=1e-12)


@pytest.mark.parametrize("schedule,world", [("1f1b", 2), ("zb", 3)])
def test_a_model_cast_after_compile_steps_in_its_new_dtype_and_back(schedule, world, tmp_path, launch):
    # the crossing values' specs were cached per input layout only, and the propagation's fake
    # weights kept their first dtype: after model.double() the receiving ranks sized float32 buffers
    # (or, once a float64 layout was cached, float64 ones after model.float()) and every later step failed
    results = launch("longrun_cases:model_cast", world, schedule, tmp_path)
    _ok(results)
    for res in results:
        assert res["failed"][0] in ("RuntimeError", "PeerFailure"), res["failed"]
        for loss_error, grad_error in res["errors"]:
            assert loss_error < 1e-5 and grad_error < 1e-5, res["errors"]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_rope_model_on_meta_saves_loads_across_ranks_and_resumes_exactly(schedule, tmp_path, launch):
    results = launch("longrun_cases:rope_resume", 2, schedule, tmp_path)
    _ok(results)
    for res in results:
        assert res["after"] == res["unbroken"][3:]
        assert res["before"] == res["unbroken"][:3]
        kind, message, written = res["differs"]
        assert kind == "CheckpointError" and not written
        assert "the ranks passed different paths or extra= to fxpipe.save (rank 0: path " in message
        assert "extra={'rank': 0}" in message and "extra={'rank': 1}" in message
        assert res["latest"] == str(tmp_path / "ckpt")


def test_a_batch_smaller_than_chunks_warns_once(tmp_path, launch):
    results = launch("longrun_cases:chunks_warning", 2, "1f1b", tmp_path)
    _ok(results)
    assert results[0]["warnings"] == ["a batch of 2 row(s) runs as 2 micro-batch(es), fewer than chunks=4: a "
                                      "micro-batch holds at least one row (said once per pipe)"]
    assert results[1]["warnings"] == []  # only the rank that splits the batch knows


def test_a_dead_rank_stops_the_others_for_good_naming_it(tmp_path, launch):
    results = launch("longrun_cases:dies_then", 3, "1f1b", tmp_path, limit=60)
    assert results[1] == {"exitcode": 3}
    for r in (0, 2):
        assert results[r]["ok"], results[r]
        kind, message, seconds = results[r]["first"]
        assert kind == "PeerFailure" and seconds < 10, results[r]
        assert "rank 1 probably died" in message or "because rank 1 died" in message, message
        kind, message, seconds = results[r]["again"]
        assert kind == "PeerFailure" and seconds < 2, results[r]
        assert "the pipeline lost a rank in an earlier step (rank 1 died" in message
        assert "resume from the last complete checkpoint (fxpipe.latest_checkpoint)" in message


def test_a_rank_dying_in_save_is_named_and_its_half_written_save_skipped(tmp_path, launch):
    # rank 0 got gloo's "Connection reset by peer ... GLHF!" from inside torch.distributed.checkpoint
    results = launch("longrun_cases:dies_saving", 2, "1f1b", tmp_path, limit=60)
    assert results[1] == {"exitcode": 3}
    kind, message, _ = results[0]["saving"]
    assert kind == "PeerFailure" and "fxpipe.save lost a peer while the ranks wrote" in message, message
    assert "restart the job and resume from the last complete checkpoint" in message
    assert results[0]["latest"] == "step-1"


def test_a_hugging_face_llama_from_a_config_trains_through_all_of_it(tmp_path, launch):
    pytest.importorskip("transformers")
    results = launch("longrun_cases:hf_llama", 2, "1f1b", tmp_path)
    _ok(results)
    for res in results:
        assert res["meta_after_compile"] == []  # a rank holds only its own stage's tensors
        assert res["failed"] in ("RuntimeError", "PeerFailure")
        for loss_error, grad_error in res["errors"]:  # 16, 24, 8 tokens; after a failure; after a load
            assert loss_error < 1e-5 and grad_error < 1e-5, res["errors"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_pipe_trains_evaluates_and_trains_again_as_eager_does(schedule, tmp_path, launch):
    # the model's own code and its batch norms differ by mode: fx and export follow pipe.train()/eval()
    results = launch("longrun_cases:modes", 2, schedule, tmp_path)
    _ok(results)
    for res in results:
        for tracer, errors in res["errors"].items():
            assert all(e < 1e-5 for row in errors for e in row), (tracer, errors)
    assert results[1]["refused"] == ["PipelineInputError", "rank 1's pipe is in eval mode but rank 0's (the first "
                                     "stage's) is in training mode: call pipe.train() or pipe.eval() on every rank, "
                                     "as every rank calls pipe.step and pipe(x)"]
    assert results[0]["refused"] == results[1]["refused"]  # told by the loss rank's word: no failed step


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_spectral_norms_recomputed_across_ranks_equal_eager(schedule, tmp_path, launch):
    # the recomputation starts from the u and v its forward read, not those later micro-batches left
    results = launch("longrun_cases:spectral", 2, schedule, tmp_path)
    _ok(results)
    for res in results:
        assert all(e < 1e-5 for row in res["errors"] for e in row), res["errors"]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_trainable_module_before_the_pipe_gets_its_gradients(schedule, tmp_path, launch):
    # a model input requiring grad: its gradient goes into the user's graph, once per step
    results = launch("longrun_cases:input_grads", 2, schedule, tmp_path)
    _ok(results)
    assert len(results[0]["errors"]) == 2
    assert all(e < 1e-6 for row in results[0]["errors"] for e in row), results[0]["errors"]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_given_other_options_or_making_other_calls_are_told_at_once(world, tmp_path, launch):
    # another schedule on one rank, or pipe(x) on one rank and pipe.step on the others, waited for the timeout
    results = launch("longrun_cases:calls_differ", world, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        kind, message, seconds = res["options"]
        assert kind == "OptionMismatchError" and seconds < 10, (r, res)
        assert message.startswith("fxpipe.compile got schedule='1f1b' on rank 0 but schedule='gpipe' on rank 1")
        assert "pass the same compile options on every rank" in message
        # refused on one rank before joining: the others waited out timeout= for it to join
        kind, message, seconds = res["invalid"]
        assert kind == "OptionMismatchError" and seconds < 10, (r, res)
        assert message.startswith(f"fxpipe.compile got chunks=2 on rank 0 but chunks=0 on rank {world - 1}"), message
        kind, message, seconds = res["weights"]  # the same options otherwise: the refusal, named on every rank
        assert seconds < 10 and (kind == "TypeError" if r else kind == "PeerFailure"), (r, res)
        assert "rank 1 refused its fxpipe.compile arguments (TypeError: weights=" in message if r == 0 else \
            message.startswith("weights="), message
        kind, message, seconds = res["calls"]
        assert seconds < 10, (r, res)
        if world == 2 and r == 1:
            assert kind == "PipelineInputError", res
            assert message.startswith("rank 1 called pipe.step but rank 0 (the first stage's) called pipe(...)")
        elif world == 2:  # rank 0 finished its forward before rank 1 refused it: rank 0 returned
            assert kind in ("returned", "PeerFailure"), res
        else:
            assert kind == "PipelineInputError", res
            assert "called pipe(...) but replica" in message or "called pipe.step but replica" in message, message
        error, seconds = res["again"]
        assert error < 1e-5 and seconds < 10, (r, res)
        # after a step: the loss's rank tells the first rank of its target, or that it calls pipe(x); under data
        # parallel a replica's first rank alone in pipe(x) waited out timeout= (the loss rank's word unread)
        for label in ("calls_later", "last_calls_later"):
            kind, message, seconds = res[label]
            assert seconds < 10 and kind in ("PipelineInputError", "PeerFailure", "returned"), (r, label, res)
            if kind == "PipelineInputError":
                assert "called pipe.step but r" in message or "called pipe(...) but r" in message, message
            if world == 4:  # refused on every rank: the replicas step on
                assert kind == "PipelineInputError", (r, label, res)
            error, seconds = res[f"{label}_again"]
            assert error < 1e-5 and seconds < 10, (r, label, res)


def test_a_save_on_one_rank_fails_one_call_on_each_rank_and_the_steps_stay_aligned(tmp_path, launch):
    # rank 0's save failed, and its next step failed too on the connections the save's peer had closed: from then on
    # rank 0's step k ran with rank 1's step k - 1, inputs of one batch against the target of the other, silently
    results = launch("longrun_cases:save_on_one_rank", 2, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        failed = [k for k, e in res["steps"] if isinstance(e, str)]
        assert failed == [1], (r, res)
        assert all(e < 1e-5 for k, e in res["steps"] if k != 1), (r, res)  # each later step equal to eager's


def test_autocast_on_one_rank_only_is_refused_and_the_pipe_steps_on(tmp_path, launch):
    # the ranks' buffers had other dtypes: gloo aborted the process (received data size doesn't match)
    results = launch("longrun_cases:autocast_on_one_rank", 2, "1f1b", tmp_path, limit=60)
    _ok(results)
    for res in results:
        assert "rank 1 runs without autocast but rank 0 (the first stage's) runs under " \
               "torch.autocast('cpu', dtype=torch.bfloat16)" in res["mixed"], res
        assert res["after"] < 1e-5, res


def test_ranks_that_built_the_model_from_other_configs_are_refused(tmp_path, launch):
    # the graphs had the same nodes: a 10-class head on rank 1 for rank 0's 4 trained silently on the wrong model
    results = launch("longrun_cases:built_otherwise", 2, "1f1b", tmp_path, limit=60)
    _ok(results)
    for res in results:
        kind, message, seconds = res["built"]
        assert kind == "GraphMismatchError" and seconds < 15, res
        assert message.startswith("rank 1 built another model than rank 0 (ranks differing: [1]): rank 1 has "
                                  "'module 4: Linear(in_features=8, out_features=10, bias=True)' where the other "
                                  "has 'module 4: Linear(in_features=8, out_features=4, bias=True)'"), message


def test_a_module_holding_a_distributed_pipe_loads_its_own_state_dict(tmp_path, launch):
    # torch's recursive load reached the pipe's modules directly: the other rank's keys were missing, strictly
    results = launch("longrun_cases:wrapped_state_dict", 2, "1f1b", tmp_path, limit=60)
    _ok(results)
    for r, res in enumerate(results):
        assert res["keys"] and all(k.startswith(f"pipe.{2 * r}.") or k.startswith(f"pipe.{2 * r + 1}.")
                                   for k in res["keys"]), res
        assert res["loaded"] is True, res


def test_a_model_compiled_across_ranks_is_not_compiled_again(tmp_path, launch):
    # the other ranks' tensors were meta on each rank: a second compile initialised them anew, silently (of a
    # submodule or a module holding the model too, which also took tensors the first pipe still ran)
    results = launch("longrun_cases:compile_twice", 2, "1f1b", tmp_path, limit=60)
    _ok(results)
    for res in results:
        for name in ("again", "part", "whole"):
            assert res[name].startswith("CompileError: this Sequential (or a submodule of it, or a module holding "
                                        "it) was compiled with runtime='distributed' on this rank already"), res


def test_a_target_missing_on_one_replica_is_named_on_every_rank_of_every_replica(tmp_path, launch):
    # replica 0's loss rank got gloo's bare 'Connection closed by peer' from the gradient reduction; then
    # every rank failed once rank 3's loss_fn had raised; now every rank refuses the step before it runs
    results = launch("longrun_cases:target_on_one_replica", 4, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        kind, message, seconds = res["failed"]
        assert kind == "PipelineInputError" and seconds < 10, (r, res)
        assert ("target=None on rank 3, which computes replica 1's loss, but a target on replica 0's"
                if r in (2, 3) else "replica 1 refused this step") in message, (r, message)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_target_lost_on_one_replica_at_a_later_step_is_refused_on_every_rank_and_the_run_goes_on(
        schedule, tmp_path, launch):
    # only the first step compared the replicas' targets: replica 0's loss_fn failed alone, the other replica
    # waited in its gradient reduction, and the failed step ended the run
    results = launch("longrun_cases:target_lost_on_one_replica_later", 4, schedule, tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        assert res["first"][0] == "returned" and res["after"][0] == "returned", (r, res)
        kind, message, seconds = res["lost"]
        assert kind == "PipelineInputError" and seconds < 10, (r, res)
        assert ("which computes replica 0's loss, but a target on replica 1's" if r in (0, 1) else
                "replica 0 refused this step (its loss rank has no target") in message, (r, message)
        assert abs(res["loss"] - res["expected"]) < 1e-5, (r, res)


def test_a_leaf_branching_on_a_value_trains_across_ranks(tmp_path, launch):
    # every step was refused: a new micro-batch's layout was propagated on fake tensors, which cannot follow it
    results = launch("longrun_cases:data_dependent_leaf", 2, "1f1b", tmp_path)
    _ok(results)
    for res in results:
        assert max(res["errors"]) < 1e-5, res


def test_pipes_called_in_another_order_on_each_rank_are_named_at_the_timeout(tmp_path, launch):
    # before: "a peer is stuck or dead (raise fxpipe.compile(..., timeout=) ...)", which sent users the wrong way
    results = launch("order_cases:out_of_order", 2, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        kind, message, seconds = res["first"]
        assert kind == "PeerFailure" and seconds < 30, (r, res)
        assert "every rank must call its pipes in the same order" in message, (r, message)
    for res in results:  # each names both pipes (in its own words, or in the peer's that timed out first)
        assert "pipe #1" in res["first"][1] and "pipe #2" in res["first"][1], res
    # going on after it paired one rank's call with another's next one (inputs of batch i against the target of
    # batch i + 1, silently): every later call is refused on every rank, naming the order
    for r, res in enumerate(results):
        assert res["next"][0] == "PeerFailure" and "every rank must call its pipes in the same order" in res["next"][1]
        assert res["after"][0] == "PeerFailure" and "called their pipes in different orders" in res["after"][1], res


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_of_one_pipeline_given_different_rows_are_refused_and_data_shard_shards_over_replicas(
        world, tmp_path, launch):
    # DistributedSampler(ds) shards over every rank: rank 0's inputs trained against rank 1's targets, silently
    results = launch("longrun_cases:sharded_per_rank", world, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        assert res["shard"] == ([1, 0] if world == 2 else [2, r // 2]), res
        message = _refused(res, "every_rank_own_rows", r)
        assert ("another input 'ids' than rank" in message or "replica" in message) and \
            "DistributedSampler(dataset, *fxpipe.data_shard(pipe))" in message, (r, message)
        message = _refused(res, "target_alone_differs", r)
        assert "another target than rank" in message or "refused this step" in message, (r, message)
        assert "another input 'ids'" in _refused(res, "forward_own_rows", r) or world == 4
        # the rows' count is named: the refusal did not say the batch sizes differed
        assert "another input 'ids' (shape (6, 16), not (8, 16)) than rank" in _refused(res, "fewer_rows", r), res
        assert res["loss_error"] < 1e-5, res


def test_a_value_for_an_input_the_trace_fixed_given_on_another_rank_is_refused(tmp_path, launch):
    # mask= (fixed to None) or scale=2.0 (fixed to None) given on rank 1 only was ignored on every schedule, silently
    results = launch("longrun_cases:fixed_input_on_one_rank", 2, "1f1b", tmp_path, limit=90)
    _ok(results)
    for r, res in enumerate(results):
        assert "rank 1 was given inputs the pipe refuses: mask= was fixed to None" in _refused(res, "first", r), res
        assert "rank 1 was given inputs the pipe refuses: scale= was fixed to None" in \
            _refused(res, "scale_first", r), res
        kind, message, _ = res["later"]
        assert kind != "returned" and "mask= was fixed to None" in message, (r, res["later"])
        assert res["loss_error"] < 1e-5, res


def test_a_shape_only_the_last_stage_cannot_take_is_refused_on_every_rank_before_the_call(tmp_path, launch):
    # before: the last rank raised torch's error mid-call; under pipe(x) the first rank had returned None
    results = launch("longrun_cases:too_long_for_the_last_stage", 2, "1f1b", tmp_path)
    _ok(results)
    for r, res in enumerate(results):
        for when in ("call", "step"):
            kind, message, _ = res[when]
            assert kind == "PipelineInputError", (r, when, res[when])
            assert "node 'add'" in message and "nothing ran" in message, (r, when, message)
        assert res["after"][0] == "returned", (r, res["after"])


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_call_skipped_on_one_rank_is_named_when_its_script_ends(schedule, tmp_path, launch):
    # the rank that skipped a step ended its script; the first rank's last step was told "rank 1 probably died"
    results = launch("longrun_cases:skipped_call", 2, schedule, tmp_path, limit=90)
    _ok(results)
    assert [c[0] for c in results[1]["calls"]] == ["returned", "returned"], results[1]
    kind, message, seconds = results[0]["calls"][-1]
    assert kind == "PeerFailure" and seconds < 10, results[0]
    assert "the script of rank 1 after 2 call(s) of this pipe ended while rank 0 is in its call 3" in message, message
    assert "a call skipped on one rank" in message and "resume from a checkpoint saved before the skip" in message
