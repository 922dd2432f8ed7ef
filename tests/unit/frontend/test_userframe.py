import os
import traceback

from fxpipe.frontend.userframe import outside_torch


def _frame(*parts: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(os.path.join(os.sep, "site", *parts), 10, "forward")


def test_the_line_is_the_innermost_outside_torch():
    import torch

    frames = [_frame("train.py"), _frame("model.py"),
              traceback.FrameSummary(os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py"), 1, "f")]
    assert outside_torch(frames).filename.endswith("model.py")


def test_a_transformers_helper_gives_the_line_of_its_caller():
    # Qwen2.5-VL's trace failed in transformers' torch_compilable_check, a helper many models call
    frames = [_frame("train.py"), _frame("transformers", "models", "qwen", "modeling_qwen.py"),
              _frame("transformers", "utils", "import_utils.py")]
    assert outside_torch(frames).filename.endswith("modeling_qwen.py")
    assert outside_torch(frames[2:]).filename.endswith("import_utils.py")  # nothing else: the helper's own
