"""A process's training state by FQN, as flat dicts a checkpoint stores: optimizer, RNG, fxpipe's own.

    optimizer  {"state.<fqn>.<name>": value, "param_groups.<fqn>": ((hyperparameter, value), ...)}
               for the parameters this process holds, so any other plan finds each parameter's
               moments, step count and hyperparameters under its FQN
    rng        {"<rank>.cpu": bytes, "<rank>.cuda.<device>": bytes} (torch's generator states)
    fxpipe     {"<rank>.bn.<module fqn>.<sum|sum_squares|count>": tensor}: deferred batch-norm
               statistics accumulated and not yet committed (between steps there are none)

A state name never holds a dot, so a state key splits at its last dot. The hyperparameters
of a parameter are one tuple (one item to store, not one per hyperparameter); so is a state
that is a list (LBFGS's history), given back as a list: torch.distributed.checkpoint would
store a list holding tensors item by item, under keys that no longer split at the name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fxpipe.errors import CheckpointError

__all__ = [
    "batch_norm_state",
    "check_optimizer_groups",
    "load_optimizer_state",
    "optimizer_state",
    "rng_state",
    "set_batch_norm_state",
    "set_rng_state",
]


def _names(model: nn.Module) -> dict[int, str]:
    """Return ``id(parameter) -> FQN`` (a tied parameter's first FQN)."""
    return {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """Return the optimizer's state and hyperparameters of the real (held) parameters, by FQN."""
    names = _names(model)
    saved = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in names]
    if unknown:
        raise CheckpointError(f"the optimizer holds {len(unknown)} parameter(s) that are not the model's; "
                              "build it from pipe.parameters() (or the model's)")
    out: dict[str, Any] = {}
    for index, state in saved["state"].items():
        p = params[index]
        if not p.is_meta:
            out.update({f"state.{names[id(p)]}.{k}": _whole(v) for k, v in state.items()})
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        for p in group["params"]:
            if not p.is_meta:
                out[f"param_groups.{names[id(p)]}"] = tuple(hyper.items())
    return out


def _whole(value: Any) -> Any:
    """Store a list (LBFGS's history of tensors) as a tuple: a checkpoint splits a list of tensors by index."""
    return tuple(value) if isinstance(value, list) else value


def split_key(key: str) -> tuple[str, str, str]:
    """Split ``"state.<fqn>.<name>"`` into ("state", fqn, name), ``"param_groups.<fqn>"`` into (.., fqn, "")."""
    kind, _, rest = key.partition(".")
    if kind == "param_groups":
        return kind, rest, ""
    fqn, _, name = rest.rpartition(".")
    return kind, fqn, name


def _by_fqn(flat: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Return the flat optimizer dict as ({fqn: state}, {fqn: hyperparameters})."""
    states: dict[str, dict[str, Any]] = {}
    hypers: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, fqn, name = split_key(key)
        if kind == "state":
            states.setdefault(fqn, {})[name] = list(value) if isinstance(value, tuple) else value
        else:
            hypers[fqn] = dict(value)
    return states, hypers


def _same(a: Any, b: Any) -> bool:
    """Tell whether two hyperparameter values are equal (tensors by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    return bool(a == b)


def check_optimizer_groups(optimizer: torch.optim.Optimizer, model: nn.Module, flat: Mapping[str, Any]) -> None:
    """Refuse a param group whose parameters were saved with different hyperparameters.

    Hyperparameters are per group: loading would give every parameter of the group one of
    them (weight decay on the biases that had none, say).
    """
    _, hypers = _by_fqn(flat)
    names = _names(model)
    for i, group in enumerate(optimizer.param_groups):
        saved = [(names[id(p)], hypers[names[id(p)]]) for p in group["params"]
                 if names.get(id(p)) in hypers]
        for fqn, hyper in saved[1:]:
            first, values = saved[0]
            differ = sorted(k for k in hyper.keys() | values.keys()
                            if not _same(hyper.get(k), values.get(k)))
            if differ:
                key = differ[0]
                raise CheckpointError(
                    f"param group {i} of the optimizer holds '{first}' and '{fqn}', saved with different "
                    f"{differ} ({key}={values.get(key)!r} and {hyper.get(key)!r}); one group has one value "
                    "of each: group the parameters as when the checkpoint was saved")


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, flat: Mapping[str, Any]) -> None:
    """Give the optimizer the saved state and hyperparameters of each of its parameters, by FQN."""
    states, hypers = _by_fqn(flat)
    names = _names(model)
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for p in group["params"]:
            fqn = names.get(id(p), "")
            if fqn in states:
                state[index] = states[fqn]
            hyper.update(hypers.get(fqn, {}))
            ids.append(index)
            index += 1
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_state(rank: int) -> dict[str, torch.Tensor]:
    """Return this process's CPU and CUDA generator states under ``"<rank>."`` keys."""
    out = {f"{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update({f"{rank}.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def set_rng_state(rank: int, flat: Mapping[str, torch.Tensor]) -> None:
    """Restore this process's generators from :func:`rng_state`'s dict."""
    torch.set_rng_state(flat[f"{rank}.cpu"])
    for key, state in flat.items():
        parts = key.split(".")
        if parts[:2] == [str(rank), "cuda"] and torch.cuda.is_available() and int(parts[2]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(state, int(parts[2]))


def _bn_name(names: Mapping[int, str], bn: Any) -> str:
    """Return a deferred batch norm's name in the model: its module's, or an exported graph's record's."""
    name = names.get(id(bn))
    return bn.fqn if name is None else name


def batch_norm_state(rank: int, modules: Iterable[nn.Module], model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the deferred batch norms' accumulated, uncommitted sums (none between steps)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for bn in modules:
        if getattr(bn, "_fxpipe_count", 0):
            key = f"{rank}.bn.{_bn_name(names, bn)}"
            sums = vars(bn)
            out[f"{key}.sum"] = sums["_fxpipe_sum"]
            out[f"{key}.sum_squares"] = sums["_fxpipe_sum_squares"]
            out[f"{key}.count"] = torch.tensor(sums["_fxpipe_count"])
    return out


def set_batch_norm_state(rank: int, modules: Iterable[nn.Module], model: nn.Module,
                         flat: Mapping[str, torch.Tensor]) -> None:
    """Put back the deferred batch norms' sums saved by :func:`batch_norm_state`."""
    names = {id(m): n for n, m in model.named_modules()}
    for bn in modules:
        key = f"{rank}.bn.{_bn_name(names, bn)}"
        if f"{key}.count" in flat:
            vars(bn).update(_fxpipe_sum=flat[f"{key}.sum"], _fxpipe_sum_squares=flat[f"{key}.sum_squares"],
                            _fxpipe_count=int(flat[f"{key}.count"]))
