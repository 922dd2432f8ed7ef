"""MODEL specs: file.py:factory and module:factory, what a factory may return, user errors."""

import pytest
import torch
from torch import nn

from fxpipe.tools.factory import FactoryError, ModelSpecError, load_factory, make_model


def test_module_spec_and_the_three_return_forms(tmp_path):
    import unet  # examples/, on sys.path in the tests

    assert load_factory("unet:factory") is unet.factory
    path = tmp_path / "forms.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "def bare():\n    return nn.Linear(3, 2)\n"
        "def one():\n    return nn.Linear(3, 2), torch.ones(4, 3)\n"
        "def three():\n    return nn.Linear(3, 2), [torch.ones(4, 3)], {'scale': 2.0}\n")
    model, inputs, kwargs = make_model(f"{path}:bare", None)
    assert isinstance(model, nn.Linear) and inputs is None and kwargs == {}
    _, inputs, _ = make_model(f"{path}:one", None)
    assert isinstance(inputs, tuple) and inputs[0].shape == (4, 3)
    _, inputs, kwargs = make_model(f"{path}:three", None)
    assert len(inputs) == 1 and kwargs == {"scale": 2.0}
    _, inputs, kwargs = make_model(f"{path}:three", [(5, 3), (5, 1)])  # shapes replace the inputs
    assert [tuple(x.shape) for x in inputs] == [(5, 3), (5, 1)] and kwargs == {}
    assert all(x.dtype == torch.float32 for x in inputs)


def test_user_errors_name_the_cause_and_the_line(tmp_path):
    path = tmp_path / "broken_import.py"
    path.write_text("import torch\n\nraise RuntimeError('needs a GPU')\n")
    with pytest.raises(FactoryError, match=r"importing .*broken_import.py raised RuntimeError: needs a GPU "
                                           r"\(File .*broken_import.py\", line 3"):
        load_factory(f"{path}:factory")
    path = tmp_path / "returns.py"
    path.write_text("def factory():\n    return 'a model'\n")
    with pytest.raises(FactoryError, match="returned str; return an nn.Module, or \\(model, example_inputs\\)"):
        make_model(f"{path}:factory", None)
    with pytest.raises(ModelSpecError, match="is not FILE.py:FACTORY or MODULE:FACTORY"):
        load_factory(":factory")
    with pytest.raises(FactoryError, match="No module named 'not_installed_dep'"):
        dep = tmp_path / "needs_dep.py"
        dep.write_text("import not_installed_dep\n")
        load_factory(f"{dep}:factory")


def test_a_factory_needing_arguments_is_refused_naming_them(tmp_path):
    # it was a TypeError from the lambda calling it, reported at factory.py's line
    path = tmp_path / "needs.py"
    path.write_text("from torch import nn\ndef factory(width, *, depth=2):\n    return nn.Linear(width, width)\n"
                    "def sized(seq):\n    return nn.Linear(seq, seq)\n")
    with pytest.raises(ModelSpecError, match=r"the factory needs 'width', which the command cannot give"):
        make_model(f"{path}:factory", None)
    model, _, _ = make_model(f"{path}:sized", None, {"seq": 3})  # an option the command gives is not missing
    assert model.in_features == 3
