"""Weight sources: how a directory or file names each FQN, read as a model of the Hugging Face Hub needs."""

import json

import pytest
import torch
from torch import nn

import fxpipe


class CausalLM(nn.Module):
    """FQNs named as Hugging Face's ``*ForCausalLM`` name them: a body under ``model.`` and a head beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.lm_head = nn.Linear(4, 2)


def on_meta() -> nn.Module:
    with torch.device("meta"):
        return CausalLM()


def assert_state(model: nn.Module, state: dict) -> None:
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_directory_whose_fqns_begin_with_model_is_read_at_the_top(tmp_path, recwarn):
    import torch.distributed.checkpoint as dcp

    state = CausalLM().state_dict()
    dcp.save(dict(state), checkpoint_id=tmp_path / "top", no_dist=True)  # keys model.0.weight, lm_head.weight
    dcp.save({"model": dict(state)}, checkpoint_id=tmp_path / "under", no_dist=True)  # model.model.0.weight
    for name in ("top", "under"):
        assert_state(fxpipe.materialize(on_meta(), weights=tmp_path / name), state)
    assert not [w for w in recwarn if "name no parameter" in str(w.message)]


def test_a_hub_directory_with_safetensors_and_bin_copies_reads_the_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    state = CausalLM().state_dict()
    st.save_file(dict(state), str(tmp_path / "model.safetensors"))
    torch.save({"lr": 1.0}, tmp_path / "training_args.bin")  # not weights, but a .bin
    (tmp_path / "config.json").write_text("{}")
    assert_state(fxpipe.materialize(on_meta(), weights=tmp_path), state)
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    for stem in ("model.safetensors", "pytorch_model.bin"):  # two indexes: the safetensors one
        index = {"metadata": {}, "weight_map": dict.fromkeys(state, stem)}
        (tmp_path / f"{stem}.index.json").write_text(json.dumps(index))
    assert_state(fxpipe.materialize(on_meta(), weights=tmp_path), state)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    zeros = fxpipe.materialize(on_meta(), weights=tmp_path)  # pytorch_model.bin beside training_args.bin
    assert all(not v.any() for v in zeros.state_dict().values())


def test_a_safetensors_float8_file_is_refused_naming_its_real_dtype(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    state = {k: v.to(torch.float8_e4m3fn) for k, v in CausalLM().state_dict().items()}
    st.save_file(state, str(tmp_path / "fp8.safetensors"))
    with pytest.raises(fxpipe.WeightsError, match=r"'model.0.weight' has dtype torch.float8_e4m3fn there but "
                                                  r"torch.float32 in the model.*cast the model to it first"):
        fxpipe.materialize(on_meta(), weights=tmp_path / "fp8.safetensors")


def test_a_file_that_is_not_weights_is_named_as_such(tmp_path):
    # a config.json passed as weights=: torch's mmap note asked to re-save it with _use_new_zipfile_serialization
    import fxpipe
    from fxpipe.errors import WeightsError

    path = tmp_path / "config.json"
    path.write_text('{"hidden": 8}')
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(WeightsError, match=r"config.json' is not a weights file \(it starts b'\{\"hi'\): pass a "
                                           r"\.safetensors file"):
        fxpipe.materialize(model, weights=str(path))
