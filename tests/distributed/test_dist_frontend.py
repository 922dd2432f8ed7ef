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
