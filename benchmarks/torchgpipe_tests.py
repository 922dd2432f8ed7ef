"""Run torchgpipe 0.0.7's own test suite against fxpipe.compat.torchgpipe, side by side with torchgpipe.

torchgpipe's tests are not in its PyPI package; give this script a checkout of its repository
(``git clone https://github.com/kakaobrain/torchgpipe && git -C torchgpipe checkout v0.0.7``).
The tests are copied to a temporary directory, their imports rewritten from ``torchgpipe`` to
``fxpipe.compat.torchgpipe``, and run with pytest; with ``--against both`` (the default) the
unmodified copy also runs against the installed torchgpipe (``pip install torchgpipe==0.0.7
--no-deps``), and a table shows both outcomes per test::

    python benchmarks/torchgpipe_tests.py path/to/torchgpipe [--against fxpipe|torchgpipe|both]

Two changes besides the imports, listed in the output:

- ``pytest.warns(None)`` (removed in pytest 8) becomes a block that records warnings, so the
  two tests asserting "no warning" can run at all (in both runs);
- in ``tests/skip/test_gpipe.py`` (fxpipe's run only), the portal classes imported only to assert that no portal
  appears in the autograd graph come from a stub module: fxpipe has no portals, so the
  assertion holds trivially, and the test's real check (a ``None`` skip) runs.

Tests of torchgpipe internals (its pipeline, micro-batch, stream, copy, worker, portal and
dependency modules) cannot apply and are left out with the reason; CUDA tests skip on a
machine without CUDA. The exit status is 0 when every test that applies passes on fxpipe.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

# Tests that cannot apply to fxpipe, with the reason: they import or exercise torchgpipe internals.
NOT_APPLICABLE = {
    "tests/test_checkpoint.py": "internals: torchgpipe.checkpoint.Checkpointing, torchgpipe.dependency "
                                "fork/join and torchgpipe.microbatch.Batch (fxpipe's own checkpoint "
                                "tests cover the behaviour)",
    "tests/test_copy.py": "internals: torchgpipe.copy Copy/Wait autograd functions and CUDA streams",
    "tests/test_dependency.py": "internals: torchgpipe.dependency Fork/Join and phony tensors",
    "tests/test_microbatch.py": "internals: torchgpipe.microbatch Batch/check/scatter/gather",
    "tests/test_phony.py": "internals: torchgpipe.phony",
    "tests/test_pipeline.py": "internals: torchgpipe.pipeline Pipeline/clock_cycles",
    "tests/test_stream.py": "internals: torchgpipe.stream (CUDA stream helpers)",
    "tests/test_worker.py": "internals: torchgpipe.worker threads and queues",
    "tests/skip/test_portal.py": "internals: torchgpipe.skip.portal (fxpipe routes skips without portals)",
    "tests/skip/test_tracker.py": "internals: SkipTrackerThroughPotals, torchgpipe.microbatch.Batch and "
                                  "torchgpipe.checkpoint.enable_checkpointing/enable_recomputing",
    "tests/skip/test_leak.py": "internals: the life count of torchgpipe's portal tensors "
                               "(skip_tracker.portals, Portal.__init__)",
    "tests/test_balance.py::test_deprecated_torchgpipe_balancing":
        "checks torchgpipe's own deprecated top-level module torchgpipe_balancing",
    "tests/test_deferred_batch_norm.py::test_input_requiring_grad":
        "fails on torchgpipe 0.0.7 itself under torch 2.x: the test changes a leaf that requires "
        "grad in place (tilt_dist) before any batch norm runs",
}

PORTAL_STUB = '''"""Stand-ins for torchgpipe's portal autograd functions: fxpipe has no portals."""
import torch


class PortalBlue(torch.autograd.Function):
    pass


class PortalOrange(torch.autograd.Function):
    pass


class PortalCopy(torch.autograd.Function):
    pass
'''

WARNS_NONE = '''
import contextlib as _contextlib
import warnings as _warnings


@_contextlib.contextmanager
def _warns_none():
    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        yield record
'''


def rewrite(source: str, path: str, target: str) -> tuple[str, list[str]]:
    """Return a test file's source prepared for ``target`` and the list of changes made."""
    changes = []
    if "pytest.warns(None)" in source:
        source = source.replace("pytest.warns(None)", "_warns_none()")
        head, sep, rest = source.partition("\n\n\n")
        source = head + "\n" + WARNS_NONE + sep + rest
        changes.append("pytest.warns(None) -> a block recording warnings (pytest 8)")
    if target == "fxpipe" and path.endswith(os.path.join("skip", "test_gpipe.py")):
        source = source.replace("from torchgpipe.skip.portal import", "from _portal_stub import")
        changes.append("portal classes from a stub module")
    if target == "fxpipe":
        new = re.sub(r"\b(from|import) torchgpipe\b(?!_)", r"\1 fxpipe.compat.torchgpipe", source)
        new = re.sub(r"(['\"])torchgpipe\.", r"\1fxpipe.compat.torchgpipe.", new)
        if new != source:
            changes.append("imports torchgpipe -> fxpipe.compat.torchgpipe")
        source = new
    return source, changes


def prepare(checkout: str, target: str, root: str) -> dict[str, list[str]]:
    """Copy the checkout's tests into ``root`` rewritten for ``target``; return the changes per file."""
    src = os.path.join(checkout, "tests")
    if not os.path.isdir(src):
        raise SystemExit(f"{checkout} has no tests/ directory; give a checkout of kakaobrain/torchgpipe")
    shutil.copytree(src, os.path.join(root, "tests"))
    with open(os.path.join(root, "_portal_stub.py"), "w") as f:
        f.write(PORTAL_STUB)
    changed = {}
    for folder, _, files in os.walk(os.path.join(root, "tests")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                source, changes = rewrite(f.read(), path, target)
            with open(path, "w") as f:
                f.write(source)
            if changes:
                changed[os.path.relpath(path, root)] = changes
    return changed


def run(checkout: str, target: str, extra: list[str]) -> dict[str, str]:
    """Run the prepared tests for ``target``; return each test's outcome by node id."""
    with tempfile.TemporaryDirectory(prefix=f"torchgpipe-tests-{target}-") as root:
        prepare(checkout, target, root)
        report = os.path.join(root, "report.xml")
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", root,
                f"--junitxml={report}", "--continue-on-collection-errors", "tests"]
        for test in NOT_APPLICABLE:
            args += ["--ignore", test] if "::" not in test else ["--deselect", test]
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(args + extra, cwd=root, env=env, check=False)
        return outcomes(report)


def outcomes(report: str) -> dict[str, str]:
    """Read a JUnit XML report into {node id: passed | failed | skipped | xfailed}."""
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        node = f"{path}.py::{case.get('name')}"
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        result[node] = status
    return result


def main() -> int:
    """Run the suite and print the side-by-side table; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", help="a checkout of github.com/kakaobrain/torchgpipe (tag v0.0.7)")
    parser.add_argument("--against", choices=["fxpipe", "torchgpipe", "both"], default="both")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    opts = parser.parse_args()
    targets = ["fxpipe", "torchgpipe"] if opts.against == "both" else [opts.against]
    if "torchgpipe" in targets and importlib.util.find_spec("torchgpipe") is None:
        print("torchgpipe is not installed (pip install torchgpipe==0.0.7 --no-deps): running fxpipe only")
        targets = [t for t in targets if t != "torchgpipe"]
    results = {t: run(os.path.abspath(opts.checkout), t, opts.pytest_args) for t in targets}
    with tempfile.TemporaryDirectory() as root:
        for path, changes in sorted(prepare(opts.checkout, "fxpipe", root).items()):
            print(f"changed {path}: {'; '.join(changes)}")
    names = sorted(set().union(*results.values()))
    width = max(map(len, names), default=10)
    print(f"\n{'test':<{width}}  " + "  ".join(f"{t:<10}" for t in targets))
    for name in names:
        print(f"{name:<{width}}  " + "  ".join(f"{results[t].get(name, '-'):<10}" for t in targets))
    print("\nnot applicable:")
    for test, reason in NOT_APPLICABLE.items():
        print(f"  {test}: {reason}")
    for t in targets:
        counts = {s: list(results[t].values()).count(s) for s in ("passed", "failed", "skipped", "xfailed")}
        print(f"{t}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if "fxpipe" in results and "failed" in results["fxpipe"].values() else 0


if __name__ == "__main__":
    sys.exit(main())
