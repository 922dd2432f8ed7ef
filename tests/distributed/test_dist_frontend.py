"""Multi-process tests of export_meta (from tests/unit/frontend/test_export_meta.py), on gloo ranks."""



def test_a_rotary_decoder_on_meta_exported_on_two_ranks_equals_eager(tmp_path, launch):

    results = launch("export_meta", 2, "1f1b", tmp_path, limit=150)
    for r, ranked in enumerate(results):
        assert ranked["ok"], f"rank {r}: {ranked.get('traceback')}"
        for examples in ("real", "meta"):  # example inputs on CPU, or on meta as the model
            res = ranked[examples]
            assert res["loss_error"] < 1e-5 and res["grad_errors"], (r, examples)
            assert max(res["grad_errors"].values()) < 1e-5, (r, examples, res["grad_errors"])
            assert res["wrong"] == [], (r, examples)  # held tensors real, every other on meta
            assert res["called"].startswith("CompileError: RotaryDecoder was compiled with runtime='distributed'"), \
                res["called"]
    assert 0 < len(results[0]["real"]["owned"]) < len(results[0]["real"]["all"])


def test_an_exported_model_keeps_only_its_stage_per_rank_and_saves_the_trained_weights(tmp_path, launch):

    results = launch("export_cases:real_weights", 2, "1f1b", tmp_path, limit=60)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["wrong"] == [], r  # held tensors real, every other on meta
        assert res["stale"] == [], r  # the checkpoint holds the owner's trained values
    assert set(results[0]["mine"]).isdisjoint(results[1]["mine"])


def test_a_model_sharded_before_compile_is_refused_naming_the_fix(tmp_path, launch):
    # fully_shard's DTensors reached the ranks' weight comparison: ".tolist() is not supported for
    # tensor subclasses" (one process: a PropagationError suggesting tracer='export')
    results = launch("prewrapped", 2, "1f1b", tmp_path, limit=60)
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        refused = res["refused"]
        for label in ("fsdp2 root", "fsdp2 inner"):
            assert refused[label][0] == "TypeError", refused[label]
            assert "fully_shard (FSDP2) was applied" in refused[label][1]
            assert "data_parallel_shard=True" in refused[label][1]
        assert "module '0'" in refused["fsdp2 inner"][1]
        assert refused["tensor parallel"][0] == "TypeError", refused["tensor parallel"]
        assert "'0.weight' is a DTensor" in refused["tensor parallel"][1] and "tensor_parallel=N" in refused["tensor parallel"][1]
