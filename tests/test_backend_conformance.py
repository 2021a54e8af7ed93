"""Contract 1: one attention-backend interface. Every concrete backend and wrapper implements
every hook of `AttentionBackend` with the interface's exact signature; nobody probes hooks."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from abc import abstractmethod
from pathlib import Path

import pytest

import attention
from attention.base import AttentionBackend

HOOKS = sorted(AttentionBackend.__abstractmethods__)


# GPU-only kernel modules need these; the backends never import them at module level, so a
# CPU machine without them still sees every backend class.
OPTIONAL_GPU_DEPS = {"triton", "flash_attn"}


def all_backend_classes() -> list[type]:
    for mod in pkgutil.iter_modules(attention.__path__):
        try:
            importlib.import_module(f"attention.{mod.name}")
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL_GPU_DEPS:
                raise
    seen, stack = [], [AttentionBackend]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub.__module__.startswith("attention.") and sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return [c for c in seen if not inspect.isabstract(c)]


def conformance_errors(cls: type) -> list[str]:
    errors = []
    for hook in HOOKS:
        impl = getattr(cls, hook, None)
        if impl is None or getattr(impl, "__isabstractmethod__", False):
            errors.append(f"{cls.__name__} misses hook {hook}")
            continue
        want = inspect.signature(getattr(AttentionBackend, hook))
        got = inspect.signature(impl)
        if list(want.parameters) != list(got.parameters):
            errors.append(f"{cls.__name__}.{hook}{got} != interface {want}")
    return errors


def test_interface_declares_the_hooks_the_design_names():
    for hook in ("init_forward_metadata", "forward_extend", "forward_decode", "init_mha_chunk_metadata",
                 "init_cuda_graph_state", "init_forward_metadata_capture_cuda_graph",
                 "init_forward_metadata_replay_cuda_graph", "get_cuda_graph_seq_len_fill_value"):
        assert hook in HOOKS


def test_there_are_backends_to_check():
    names = {c.__name__ for c in all_backend_classes()}
    assert {"TorchReferenceBackend", "FlashAttentionBackend",
            "HybridLinearAttnBackend", "LinearAttentionBackend"} <= names


@pytest.mark.parametrize("cls", all_backend_classes(), ids=lambda c: c.__name__)
def test_backend_implements_every_hook(cls):
    assert conformance_errors(cls) == []


def test_an_incomplete_backend_is_caught():
    class Incomplete(AttentionBackend):
        def init_forward_metadata(self, forward_batch):  # noqa: D401
            pass

        def forward_extend(self, q, k, v, layer):  # wrong signature: fewer arguments
            pass

    errors = conformance_errors(Incomplete)
    assert any("misses hook init_mha_chunk_metadata" in e for e in errors)
    assert any("forward_extend" in e and "!=" in e for e in errors)


def _hybrid():
    from attention.hybrid_linear import HybridLinearAttnBackend

    return HybridLinearAttnBackend


@pytest.mark.parametrize("hook", HOOKS)
def test_a_hybrid_wrapper_missing_a_hook_is_caught(hook):
    """The real bug: the hybrid wrapper had no init_mha_chunk_metadata. A copy of the wrapper
    rebuilt by type() without one hook, and a subclass that makes one abstract again, are
    both reported."""
    hybrid = _hybrid()
    assert conformance_errors(hybrid) == []
    skip = {hook, "__dict__", "__weakref__", "__abstractmethods__", "_abc_impl"}
    namespace = {k: v for k, v in vars(hybrid).items() if k not in skip}
    copy = type("HybridWithout", (AttentionBackend,), {**namespace, "__module__": __name__})
    assert conformance_errors(copy) == [f"HybridWithout misses hook {hook}"]

    def stub(self, *args):
        pass

    again = type("HybridAbstract", (hybrid,), {hook: abstractmethod(stub), "__module__": __name__})
    assert conformance_errors(again) == [f"HybridAbstract misses hook {hook}"]


def test_a_hybrid_wrapper_hook_with_other_arguments_is_caught():
    """The same bug's other half: a backend's init_mha_chunk_metadata took fewer arguments than
    the wrapper passed it (and another took one more), so delegation raised TypeError."""

    class Fewer(_hybrid()):
        def init_mha_chunk_metadata(self):  # type: ignore[override]
            pass

    class More(_hybrid()):
        def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged=False):  # type: ignore[override]
            pass

    for cls in (Fewer, More):
        errors = conformance_errors(cls)
        assert len(errors) == 1 and errors[0].startswith(f"{cls.__name__}.init_mha_chunk_metadata("), errors


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_of_the_wrapper_is_checked_for_fewer_arguments(hook):
    want = inspect.signature(getattr(AttentionBackend, hook))
    params = list(want.parameters.values())
    fewer = params[:-1] if len(params) > 1 else [*params, inspect.Parameter("extra", inspect.Parameter.POSITIONAL_OR_KEYWORD)]

    def stub(self, *args):
        pass

    stub.__signature__ = want.replace(parameters=fewer)  # type: ignore[attr-defined]
    broken = type("HybridChanged", (_hybrid(),), {hook: stub, "__module__": __name__})
    errors = conformance_errors(broken)
    assert len(errors) == 1 and errors[0].startswith(f"HybridChanged.{hook}("), errors


def test_no_hasattr_probing_of_hooks():
    roots = [Path(attention.__file__).parent, Path(attention.__file__).parent.parent / "workers"]
    pattern = re.compile(r"hasattr\([^)]*(" + "|".join(HOOKS) + r")")
    offenders = [str(p) for root in roots for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
