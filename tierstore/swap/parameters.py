"""Parameter offloading: a module's weights live in the store and visit the device tier only
while a submodule computes with them.

``offload_parameters(module, store)`` moves every parameter into the store (``tier``, host by
default, or disk) and leaves a zero-size placeholder in the module. Around each submodule that
owns parameters (a *unit*), hooks hold its parameters on the device tier -- the store's own
buffers -- for its forward, release them after it (even when it raises), hold them again before
its backward (once the gradient of one of its outputs is computed) and release each once its
gradient is accumulated (a frozen one, or one whose gradient the backward does not accumulate,
once the unit's backward passed a gradient on to its inputs; any left, such as one without a
gradient, when the backward ends). These are hooks on the autograd graph the unit's forward
made, not module backward hooks: the graph stays the plain model's (same gradients, bit for
bit; in-place changes of a unit's output allowed). A release ends the store's hold
only after the kernels queued until then, which may still read the weights, are done
(``link.mark()`` on the training thread, awaited on the loop). Autograd would keep a reference to the
forward-time buffers of the weights it saves for backward (and read them there, after the store
reused them), so while the module runs forward, ``saved_tensors_hooks`` replace each saved
parameter, or view of one, by a reference that backward resolves against the weights held again
then; other saved tensors go to the ``offload_activations`` context active around the forward,
if any, or stay as they are. Each parameter must be used inside a module that owns it, or
inside one of the ``WHOLE_UNITS`` (torch's attention and transformer layers, which read their
children's weights themselves) it is under, made one unit with its children's weights. A
parameter several modules share (tied input and output embeddings) is stored once, under the
name the first module gives it, and held while any of them computes. While a unit computes,
the units that come next are prefetched to the device tier, in the order recorded in the previous step (forward
order, then backward order). The device tier's capacity bounds what is resident at once, so a
model whose weights exceed it still trains.

Gradients land in ``param.grad`` as usual; ``TieredAdamW`` (or any ``PagedOptimizer``) sees
that a parameter is offloaded and writes its updated weight into the store instead of into the
placeholder. ``detach()`` puts the weights back into the module.

Checkpoints: ``module.state_dict()`` reads the weights from the store (``keep_vars=True`` keeps
the Parameter objects, placeholders outside a forward) and ``module.load_state_dict()`` writes
them into it, through the module's state_dict hooks. A unit that changes a held weight in
place in its forward (``nn.Embedding(max_norm=...)``) has the change stored before the hold
ends, as the plain module keeps it. An in-place change of a placeholder
(``p.mul_`` under ``no_grad``) would be lost: torch's version counter shows it, and the next
hold or ``state_dict()`` raises. A checkpoint's recomputation (``torch.utils.checkpoint``) runs
the forward inside backward, and torch's checkpoint keeps what it saves: its units' trainable
weights stay held until their gradients are accumulated, so those of a checkpointed region
must fit on the device tier together (else a ``TierFullError`` says so); its frozen weights
are copied for it (autograd frees the copies, as activations) and let go at once, so a frozen
base larger than the device tier trains checkpointed too.

Crossings: the weights go into the store at the start, and back at ``detach()``, over the
device's link (``crossing.py``); holding a weight on the device tier crosses the tier's link
inside the store.

The weights live in a namespace it claims in the store (``namespace=``, default a fresh
``swap/params/<n>/``); ``detach()`` drops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..device import Link
from ..errors import EntryHeldError, TierFullError
from ..namespaces import Namespace
from ..store import TierStore
from ..sync import SyncTierStore, loop_thread, open_unless_closed, run
from ..tiers import MemoryTier
from ..units import parse_bytes
from ..warn import warn
from .activations import _claim, _Saved, active_activation_offload, kept
from .crossing import swap_link, to_device, to_store
from .report import SwapReport

# Keyed by identity (tensors compare elementwise, so a plain WeakKeyDictionary cannot hold them).
_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()


#: Modules whose forward reads their children's weights itself (``nn.MultiheadAttention`` reads
#: ``out_proj.weight``; the transformer layers' fast path reads every weight), not through the
#: children's forward, where the hooks bring a unit's weights in: each is one unit with its
#: children's weights.
WHOLE_UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


_foreign_step_hook: Any = None


def _refuse_foreign_steps() -> None:
    """Make every torch optimizer's ``step`` refuse parameters kept in a store, unless it writes
    them there (``writes_offloaded_weights``): outside forward and backward their data is a
    size-0 placeholder, and torch's own message ("The size of tensor a (0) must match ...")
    names neither the cause nor the cure. Installed once, with the first offload."""
    global _foreign_step_hook
    if _foreign_step_hook is None:
        _foreign_step_hook = register_optimizer_step_pre_hook(_check_step)


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _REGISTRY:
        return
    inner: Any = optimizer
    for _ in range(4):  # (a wrapper, as accelerate's AcceleratedOptimizer, steps an optimizer of ours)
        if getattr(inner, "writes_offloaded_weights", False):
            return
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            break
    for group in optimizer.param_groups:
        for param in group["params"]:
            # (one without a gradient is skipped by the step, as torch skips it: a frozen offloaded backbone)
            if isinstance(param, torch.Tensor) and param.grad is not None and _REGISTRY.get(param) is not None:
                raise TypeError(
                    f"{type(optimizer).__name__}.step(): its parameters include weights that offload_parameters keeps in "
                    "a store (outside forward and backward their data is a size-0 placeholder); update them with "
                    "tierstore.optim.TieredAdamW (or TieredOptimizer), which writes the new weights into the store, "
                    "or call ParameterOffload.detach() first to put the weights back into the module"
                )


def offloaded(param: torch.Tensor) -> tuple[ParameterOffload, str] | None:
    """``(offloader, key)`` if ``param`` lives in a store through ``offload_parameters``."""
    if not _REGISTRY:  # (asked per parameter and step by the optimizer; a lookup makes a weak reference)
        return None
    found = _REGISTRY.get(param)
    if found is None:
        return None
    offloader = found[0]()
    return None if offloader is None else (offloader, found[1])


@dataclass(eq=False)
class _Weight:
    """One stored parameter, shared by every unit that uses it (tied weights are stored once)."""

    key: str
    param: nn.Parameter
    shape: torch.Size
    #: The stored weight's dtype (the parameter's when it went in).
    dtype: torch.dtype = torch.float32
    #: The parameter's strides when it was not contiguous (channels_last, a transposed weight):
    #: stored in logical order, it is held, read and put back with them (``_laid_out``), as the
    #: plain module computes with them (kernels pick their paths, and rounding, by strides).
    stride: tuple[int, ...] | None = None
    units: list[int] = field(default_factory=list)
    #: Units computing with it now; the store hold ends when the last one lets go.
    holders: set[int] = field(default_factory=set)
    hold: Any = None  # the store hold's context manager while it is held
    #: ``param._version`` when the placeholder went in: an in-place change of the placeholder
    #: (``p.mul_(2)`` under ``no_grad``) bumps it, and would be lost.
    version: int = 0
    #: The held buffer on the parameter's device, while ``hold`` is set.
    value: torch.Tensor | None = None
    #: ``param._version`` when the held buffer went in: a forward that changes the weight in
    #: place (``nn.Embedding(max_norm=...)`` renormalises rows) bumps it, and the change is
    #: stored before the hold ends (``_store_changes``).
    held_version: int = 0
    #: A frozen weight's private copy, while units a checkpoint recomputes compute with it
    #: (``borrowers`` of them): what the recomputation saves refers to it, not to store memory.
    lent: torch.Tensor | None = None
    borrowers: int = 0
    #: Whether its post-accumulate-grad hook is registered (``_hook_gradient``).
    hooked: bool = False


@dataclass(frozen=True, eq=False)
class _ParamRef:
    """What backward keeps instead of a saved parameter (or a strided view of one)."""

    #: Its offloader: the graph keeps it (the hooks on torch's stack hold it weakly).
    owner: ParameterOffload
    weight: _Weight
    size: tuple[int, ...]
    stride: tuple[int, ...]
    #: Where the view starts, in bytes past the parameter's first element.
    offset: int
    whole: bool
    #: ``param._version`` when it was saved: torch refuses a backward after an in-place change
    #: of a saved tensor, and so does ``_unpack_param``.
    version: int = 0
    #: The view's dtype: a complex parameter's ``.real``, ``.imag`` or ``view_as_real`` is a
    #: float view of it (sizes, strides and offset in its elements).
    dtype: torch.dtype | None = None
    #: Torch's lazy conjugate and negative bits of the view (``w.conj()``, ``w.mH``, the
    #: ``.imag`` of those): its bytes are the parameter's, its values are not.
    conj: bool = False
    neg: bool = False


@dataclass(eq=False)
class _Reading:
    """One ``state_dict()`` call in progress."""

    #: The modules it entered, with their prefixes, outermost first.
    entered: list[tuple[nn.Module, str]]
    #: The weights it read, by key (a tied weight is read once and shared by its names); weak:
    #: the destination holds them, and a call that raised keeps nothing alive.
    read: dict[str, weakref.ref[torch.Tensor]] = field(default_factory=dict)


def _forwardless(module: nn.Module) -> bool:
    """Whether ``module`` has no forward of its own (``nn.ParameterList``, ``nn.ParameterDict``,
    ``nn.ModuleList``...): the module holding it reads its weights in its own forward."""
    return type(module).forward is nn.Module.forward


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s own parameters and those of the modules without a forward it holds (and
    they hold, and so on), by name relative to ``module``, each once: the weights its forward
    reads."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    reach, walked = [("", module)], {id(module)}
    while reach:
        prefix, holder = reach.pop(0)
        for own, param in holder.named_parameters(recurse=False):
            found.setdefault(id(param), (prefix + own, param))
        for name, child in holder.named_children():
            if _forwardless(child) and id(child) not in walked:  # (a container held twice is walked once)
                walked.add(id(child))
                reach.append((f"{prefix}{name}.", child))
    return list(found.values())


@dataclass(eq=False)
class _Unit:
    name: str
    module: nn.Module
    weights: list[_Weight]
    #: Bytes of its weights (their data is a zero-size placeholder while they are in the store).
    nbytes: int = 0
    #: The id of the forward hook letting go of its weights (``_after_forward``), once made.
    release_hook: int = -1
    #: Whether a forward hook registered after it was warned of (``_warn_later_hooks``).
    warned: bool = False


@dataclass(frozen=True)
class _Saving:
    """A forward of the offloaded module running now: the saved-tensor hooks it pushed (None
    in backward: a checkpoint's recompute) and their ``(pack, unpack)``, its thread, and where
    it was called from (``CallSite``: a forward that ended without its hook is told from one
    still running by it, ``_forget_aborted``)."""

    hooks: Any
    pushed: Any
    thread: int
    site: CallSite


class ParameterOffload:
    """See the module docstring; make one with ``offload_parameters``."""

    def __init__(
        self,
        module: nn.Module,
        store: TierStore | SyncTierStore,
        tier: str = "host",
        device_tier: str | None = None,
        ahead: int | str = "64MiB",
        namespace: str | None = None,
        emulate_device: bool | None = None,
        whole_units: Iterable[type[nn.Module]] = (),
    ) -> None:
        extra = tuple(whole_units)
        if not all(isinstance(kind, type) and issubclass(kind, nn.Module) for kind in extra):
            raise TypeError(f"whole_units must be nn.Module classes, not {extra!r}")
        #: The module classes made one unit with their children (``WHOLE_UNITS`` and those given).
        self.whole_units: tuple[type[nn.Module], ...] = WHOLE_UNITS + extra
        self.module = module
        self.store = store.store if isinstance(store, SyncTierStore) else store
        open_unless_closed(self.store, "offload_parameters: the store given")  # (as TieredAdamW's store=)
        self.tier = tier
        self.device_tier = device_tier or self.store.tiers[0].name
        device = self.store.tier(self.device_tier)
        if not isinstance(device, MemoryTier):
            raise ValueError(f"device_tier {self.device_tier!r} must be a memory tier")
        self.device = device.device
        #: The link weights cross (the device tier's: see ``crossing.swap_link``).
        self.link: Link = swap_link(self.store, self.device, emulate_device)
        self.ahead = parse_bytes(ahead)  # (read before the claim: a typo leaves no namespace claimed)
        self.namespace: Namespace = run(_claim(self.store, namespace, "swap/params/", type(self).__name__))
        self.prefix = self.namespace.name.rstrip("/")
        self.report = SwapReport("parameters")
        self._loop = loop_thread()
        self._units: list[_Unit] = []
        self._weights: list[_Weight] = []
        self._weight_of: dict[int, _Weight] = {}
        #: The forwards of the module running now, innermost last (``_Saving``).
        self._saving: list[_Saving] = []
        #: Hooks wrapped to run as Python under torch.compile (``_as_python``), by name, once made.
        self._compile_safe: dict[str, tuple[Callable[..., Any], ...]] = {}
        self._weak_hooks = _WeakSavedHooks(self)
        self._releasing: list[Any] = []  # holds being let go on the loop
        self._hooks: list[Any] = []
        self._order: list[int] = []  # units in the order they were held this step
        self._learned: list[int] = []
        self._cursor = 0
        #: Units held by each backward now running (by graph task): at its end, they let go.
        self._in_backward: dict[int, set[int]] = {}
        #: Per thread and unit, the autograd sequence numbers its forwards running now started at.
        self._starts: dict[tuple[int, int], list[int]] = {}
        #: Units with trainable weights a checkpoint recomputes in the running backward (those
        #: weights stay held until their gradients are accumulated: they must all fit).
        self._recomputing: set[int] = set()
        #: Per unit a checkpoint is recomputing now, the frozen weights it borrowed copies of.
        self._lent: dict[int, list[list[_Weight]]] = {}
        #: Per thread, the ``state_dict()`` calls in progress there, innermost last (one a hook
        #: of another started runs inside it): ``_reading``.
        self._reading_here = threading.local()
        # The state_dict (a weak reference) being loaded now, and the weights written from it
        # (a tied weight is written once).
        self._in_dict: tuple[Any, dict[str, Any]] = (None, {})
        #: Weights a ``load_state_dict()`` covers now: their version before, and whether written.
        self._loading: dict[_Weight, tuple[int, bool]] = {}
        self._detached = False
        # A put-back under way (a close and a detach() at once, maybe on two threads' loops: the
        # second waits for the first); ``_state_lock`` guards it and ``_detached``.
        self._putting_back: concurrent.futures.Future[None] | None = None
        self._state_lock = threading.Lock()
        try:
            self._attach()
        except BaseException:
            # (refused, or a put failed: the module is as it was, and the weights put so far
            # leave with the namespace, so the store is too, and a retry may claim the name)
            try:
                run(self.namespace.drop())
            except Exception as error:  # noqa: BLE001 - the first failure is the one raised
                warnings.warn(f"offload_parameters failed, and dropping what it had put in the store failed too: {error!r}",
                              RuntimeWarning, stacklevel=2)
            raise
        # Both hold the offloader weakly: a module and offloader the program dropped without
        # detach() are collected, and their weights leave the store (``_release_dropped``).
        dropped = partial(_release_dropped, self.store, self.namespace, self.link, [(weakref.ref(w.param), w.key, w.stride) for w in self._weights])
        self._close_hook = self.store.register_close_hook(partial(_put_back_if_alive, weakref.ref(self), dropped))
        self._finalizer = weakref.finalize(self, _release_when_dropped, self.store, dropped, self._close_hook)
        self._finalizer.atexit = False  # (at exit the store's close puts the live ones back)

    # -- moving the weights in and out -------------------------------------------------------------

    def _attach(self) -> None:
        whole: list[str] = []  # (names of the modules made one unit with their children)
        for name, sub in self.module.named_modules():
            if any(not outer or name.startswith(outer + ".") for outer in whole):
                continue  # (its weights are its whole unit's)
            if name and _forwardless(sub):
                continue  # (its weights are read by the module holding it: they are that one's unit's)
            recurse = isinstance(sub, self.whole_units)
            if recurse:
                whole.append(name)
            weights = []
            for own, param in sub.named_parameters(recurse=True) if recurse else _own_parameters(sub):
                weight = self._weight_of.get(id(param))
                if weight is None:  # the first module using a tied weight names its key
                    if offloaded(param) is not None:
                        raise ValueError(f"parameter {own!r} of {name or '<root>'} is offloaded already (by another offload_parameters)")
                    weight = _Weight(f"{self.prefix}/{name}.{own}" if name else f"{self.prefix}/{own}", param, param.shape, param.dtype,
                                     _layout_of(param))
                    self._weight_of[id(param)] = weight
                    self._weights.append(weight)
                weight.units.append(len(self._units))
                weights.append(weight)
            if weights:
                self._units.append(_Unit(name or "<root>", sub, weights, sum(w.param.nbytes for w in weights)))
        sources = [w.param.detach().contiguous() for w in self._weights]
        marker = self.link.mark()  # the copies out follow whatever last wrote the weights
        run(self._store_all(sources, marker))
        for weight in self._weights:
            self.report.offloaded += 1
            self.report.bytes_out += weight.param.nbytes
            weight.param.data = _placeholder(weight.param)
            weight.version = weight.param._version
            # (the offloader weakly: the parameter is the module's, which the offloader holds,
            # so a strong value would keep both for the life of the process)
            _REGISTRY[weight.param] = (weakref.ref(self), weight.key)
        _refuse_foreign_steps()
        # prepend: a pre-hook registered before ours reads the unit's weights too (weight_norm,
        # prune, spectral_norm compute the weight from them), so the weights are there before it
        self._hooks.append(self.module.register_forward_hook(_Hook(lambda *_: self._root_hooks()[1]()), always_call=True))
        for index, unit in enumerate(self._units):
            self._hooks.append(unit.module.register_forward_pre_hook(_Hook(lambda *_, i=index: self._unit_hooks()[0](i)), prepend=True))
            # always_call: a forward that raises still lets go of the unit's weights
            release = unit.module.register_forward_hook(
                _Hook(lambda _, args, output, i=index: self._unit_hooks()[1](i, output)), always_call=True)
            unit.release_hook = release.id
            self._hooks.append(release)
        # (prepended last: where the root is a unit too, the root's runs before the unit's, which
        # would otherwise hold the weights the root's then takes for an aborted forward's)
        self._hooks.append(self.module.register_forward_pre_hook(_Hook(lambda *_: self._root_hooks()[0]()), prepend=True))
        # (the modules owning offloaded weights: a unit's, and within a whole unit its children)
        units = {id(sub) for sub in self.module.modules() if any(id(p) in self._weight_of for p in sub._parameters.values())}
        for sub in self.module.modules():  # where a state_dict() call starts and ends
            # (torch marks a state_dict hook with an attribute: a function, not a bound method)
            is_unit = id(sub) in units
            self._hooks.append(sub.register_state_dict_pre_hook(_Hook(lambda module, prefix, _: self._state_dict_enter(module, prefix))))
            self._hooks.append(sub.register_state_dict_post_hook(
                _Hook(lambda module, state_dict, prefix, _, u=is_unit: self._state_dict_hook(module, state_dict, prefix, u))))
            if is_unit:  # checkpoints see the stored weights, and load into the store
                self._hooks.append(sub.register_load_state_dict_pre_hook(_Hook(lambda *args: self._load_state_dict_hook(*args))))
                self._hooks.append(sub.register_load_state_dict_post_hook(_Hook(lambda module, _: self._loaded(module))))
        for weight in self._weights:
            self._hook_gradient(weight)

    def _hook_gradient(self, weight: _Weight) -> None:
        """Once a trainable weight's gradient is accumulated no unit computes with it any more:
        let go of it then. (Torch takes such a hook only on a tensor that requires a gradient:
        a weight unfrozen later gets its hook when it is next held.)"""
        if weight.param.requires_grad and not weight.hooked:
            weight.hooked = True
            # (the offloader weakly: torch keeps a parameter's hooks where the cycle collector
            # does not look, so a hook holding the offloader kept it, the module, and the
            # weights in the store alive for ever once the program dropped them)
            # Nor the weight's record, which holds the parameter: the parameter would keep
            # itself alive through its own hooks (the hooks find the record by its place).
            me, place = weakref.ref(self), next(i for i, w in enumerate(self._weights) if w is weight)

            def before_accumulate(_: torch.Tensor) -> None:
                live = me()
                if live is not None:
                    live._before_accumulate(live._weights[place])

            def accumulated(_: torch.Tensor) -> None:
                live = me()
                if live is not None:
                    live._let_go([live._weights[place]], everyone=True)

            self._hooks.append(weight.param.register_hook(before_accumulate))
            self._hooks.append(weight.param.register_post_accumulate_grad_hook(accumulated))

    def _before_accumulate(self, weight: _Weight) -> None:
        """A gradient reaches a weight no unit holds (a second-order backward, such as a
        gradient penalty's, reaches no unit's output hooks): hold it, so that torch
        accumulates into the weight, not its zero-size placeholder; its accumulation lets go."""
        if weight.hold is None:
            self._hold_weights([weight], weight.units[0])

    async def _store_all(self, sources: list[torch.Tensor], marker: Any) -> None:
        for weight, source in zip(self._weights, sources, strict=True):
            await to_store(self.store, weight.key, source, self.tier, self.link, marker)

    def detach(self) -> None:
        """Remove the hooks and put every weight back into the module (from the store, in the
        dtype and on the device its placeholder has now); a second call does nothing. Closing
        the store does this first (the module keeps its weights)."""
        if self._detached:
            return
        self._forget_aborted(threading.get_ident(), CallSite.here())  # (no forward follows to do it)
        self._let_go(self._weights, everyone=True)  # (here: after the kernels this thread queued)
        run(self._put_back())

    async def _put_back(self) -> None:
        """On a loop: the weights back into the module, the namespace dropped (``detach``,
        and a close of the store, where it runs first). One that fails part-way (a read
        error) can be asked again: each weight put back is left as it is. While one runs,
        another waits for it, then returns or (if it failed) tries itself."""
        while True:
            with self._state_lock:
                if self._detached:
                    return
                running = self._putting_back
                if running is None:
                    self._putting_back = running = concurrent.futures.Future()
                    break
            await asyncio.wrap_future(running)
        try:
            await self._put_back_now()
        finally:
            with self._state_lock:
                self._putting_back = None
            running.set_result(None)

    async def _put_back_now(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        changed = self._changed([w for w in self._weights if w.hold is not None])
        if changed:  # (on the loop: ``_let_go`` would block on it)
            await self._store_changed(changed, self.link.mark())
        self._let_go(self._weights, everyone=True)
        for releasing in self._releasing:
            await asyncio.wrap_future(releasing)
        self._releasing = []
        for weight in self._weights:
            param = weight.param
            if _REGISTRY.get(param) is None:
                continue  # (put back by an earlier call that failed later)
            await _put_weight_back(self.store, weight.key, param, self.link, weight.stride)
            await self.store.delete(weight.key)
        if self.namespace.live:
            await self.namespace.drop()
        with self._state_lock:
            self._detached = True
        self._close_hook.remove()
        self._finalizer.detach()

    # -- what autograd saves -------------------------------------------------------------------------------

    def _enter_saving(self) -> None:
        me, site = threading.get_ident(), CallSite.here()
        if _in_backward():  # a checkpoint's recompute: its own hooks must see what the forward saves
            self._saving.append(_Saving(None, None, me, site))
            return
        self._recover(me, site)
        pushed = self._saved_tensor_hooks()
        hooks = torch.autograd.graph.saved_tensors_hooks(*pushed)
        hooks.__enter__()
        self._saving.append(_Saving(hooks, pushed, me, site))

    def _forget_aborted(self, me: int, here: CallSite) -> bool:
        """Drop the forwards of this thread that ended without their forward hook (a
        ``KeyboardInterrupt``: torch runs a hook marked ``always_call`` for an ``Exception``
        only), popping the saved-tensor hooks each pushed where they are still torch's top.
        ``here``: where the code asking runs (``CallSite.inside``). Returns whether there was one."""
        stale = [i for i, entry in enumerate(self._saving) if entry.thread == me and not here.inside(entry.site)]
        for i in reversed(stale):  # (innermost first: torch's stack of saved-tensor hooks pops its top)
            entry = self._saving.pop(i)
            if entry.hooks is not None and _top_saved_tensor_hooks() == entry.pushed:
                entry.hooks.__exit__(None, None, None)
        if not any(entry.thread == me for entry in self._saving):  # (pushed, but interrupted before it was noted)
            _pop_saved_tensor_hooks_while(lambda top: _hooks_of(top[0]) is self._weak_hooks)
        return bool(stale)

    def _recover(self, me: int, here: CallSite) -> None:
        """At a forward's start, outside backward: let go of what a forward or a backward that
        raised left. A ``KeyboardInterrupt`` (Ctrl-C) in a unit's forward left its weights held
        and our saved-tensor hooks pushed (``_forget_aborted``); a backward that raised never
        ran its end, so the units it held stayed held (both filled the device tier at the next
        step)."""
        if self._forget_aborted(me, here):
            self._order, self._cursor = [], 0
            for key in [key for key in self._starts if key[0] == me]:
                del self._starts[key]
        if self._saving:
            return  # (a forward running on another thread: what is held may be its)
        for task in list(self._in_backward):
            self._end_backward(task)
        self._give_back_all()
        self._recomputing.clear()
        self._let_go([w for w in self._weights if w.hold is not None], everyone=True)

    def _as_python(self, name: str, *functions: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
        """``functions`` run as Python under ``torch.compile``: wrapped by
        ``torch.compiler.disable`` once dynamo is loaded (a compiled model loads it first; the
        wrappers made once, kept as ``name``), so that eager-only use neither pays for its
        import nor for the wrappers."""
        made = self._compile_safe.get(name)
        if made is None and "torch._dynamo" in sys.modules:
            made = self._compile_safe[name] = tuple(torch.compiler.disable(function) for function in functions)
        return made or functions

    def _saved_tensor_hooks(self) -> tuple[Callable[..., Any], ...]:
        """The pack and unpack hooks (``_as_python``: traced, the pack went on into the
        activations' own hook and the store, which dynamo cannot trace)."""
        return self._as_python("saved", self._weak_hooks.pack, self._weak_hooks.unpack)

    def _root_hooks(self) -> tuple[Callable[..., Any], ...]:
        """``_enter_saving`` and ``_exit_saving`` (``_as_python``: traced, what they decide was
        decided once, when compiled)."""
        return self._as_python("root", self._enter_saving, self._exit_saving)

    def _unit_hooks(self) -> tuple[Callable[..., Any], ...]:
        """``_before_forward`` and ``_after_forward`` (``_as_python``: traced, the walk of the
        graph recompiled at every call)."""
        return self._as_python("units", self._before_forward, self._after_forward)

    def _exit_saving(self) -> None:
        me = threading.get_ident()
        for i in range(len(self._saving) - 1, -1, -1):
            if self._saving[i].thread == me:
                hooks = self._saving.pop(i).hooks
                if hooks is not None:
                    hooks.__exit__(None, None, None)
                break
        if sys.exc_info()[1] is not None:  # the forward raised: no backward follows its units
            self._order = []
            self._cursor = 0
        if not self._saving and not _in_backward():  # (left by a backward that raised)
            for task in list(self._in_backward):
                self._end_backward(task)
            self._give_back_all()
            self._recomputing.clear()

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor if id(tensor) in self._weight_of else tensor._base
        weight = self._weight_of.get(id(base)) if base is not None else None
        if weight is not None and weight.param is base and offloaded(base) is not None:
            offset = tensor.storage_offset() * tensor.element_size() - base.storage_offset() * base.element_size()
            return _ParamRef(self, weight, tuple(tensor.size()), tuple(tensor.stride()), int(offset), tensor is base, base._version,
                             tensor.dtype, tensor.is_conj(), tensor.is_neg())
        activations = active_activation_offload()
        return activations._pack(tensor) if activations is not None else kept(tensor)

    def _unpack_param(self, packed: _ParamRef) -> torch.Tensor:
        """The saved parameter (or view of one) ``packed`` stands for (``_WeakSavedHooks.unpack``)."""
        weight = packed.weight
        if weight.param._version != packed.version:  # (what torch checks of a tensor it saves itself)
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"parameter {weight.key.rsplit('/', 1)[-1]!r} (stored as {weight.key!r}) is at version "
                f"{weight.param._version}; expected version {packed.version} instead (it was changed in place after "
                f"a forward saved it for backward, as torch refuses too)"
            )
        if weight.hold is None:  # used in backward outside its units' own backward
            self._hold_weights([weight], weight.units[0])
        data = weight.param.data
        if packed.whole:
            value = data
        elif packed.dtype in (None, data.dtype):
            value = data.as_strided(packed.size, packed.stride, data.storage_offset() + packed.offset // data.element_size())
        else:  # (a float view of a complex parameter: the same bytes seen in its dtype)
            start = data.storage_offset() * data.element_size() + packed.offset
            itemsize = packed.dtype.itemsize
            value = torch.empty(0, dtype=packed.dtype, device=data.device).set_(
                data.untyped_storage(), start // itemsize, packed.size, packed.stride
            )
        if packed.conj:  # (as_strided and set_ give the bytes without the bits: the values' signs were lost)
            value = value.conj()
        if packed.neg:
            value = torch._neg_view(value)
        # A backward that records a graph (create_graph=True: a gradient penalty) saves what it
        # computes with for the next backward, past the hold: it gets its own copy, as the
        # store reuses the buffer once the weight is let go.
        return value.clone() if torch.is_grad_enabled() else value

    # -- around each unit --------------------------------------------------------------------------------

    def _before_forward(self, index: int) -> None:
        """Hold the unit's weights for its forward, and note where its part of the autograd
        graph starts (``_after_forward`` hooks it)."""
        self._hold(index, forward=True)
        if torch.is_grad_enabled():
            self._starts.setdefault((threading.get_ident(), index), []).append(_next_sequence_nr())
        unit = self._units[index]
        if not unit.warned and next(reversed(unit.module._forward_hooks), unit.release_hook) != unit.release_hook:
            self._warn_later_hooks(unit)

    def _warn_later_hooks(self, unit: _Unit) -> None:
        """Warn (once per unit) that a forward hook was registered on ``unit``'s module after
        ``offload_parameters``: torch runs it after ours, which let go of the weights, so it
        would read the zero-size placeholder. (Reordering torch's hooks would hand ours what
        such a hook returned instead of the unit's output.)"""
        unit.warned = True
        warn(f"offload_parameters: a forward hook was registered on {unit.name} ({type(unit.module).__name__}) after its "
             "weights were offloaded: it runs after they are let go, so if it reads them it reads a zero-size placeholder. "
             "Register such hooks before offload_parameters or with register_forward_hook(..., prepend=True) (forward "
             "pre-hooks see the weights either way)")

    def _after_forward(self, index: int, output: Any) -> None:
        """Let go after the unit's forward, and hook the part of the autograd graph it made:
        hold again when backward reaches it (the first gradient of one of its outputs), and
        let go of what it no longer needs once its backward has passed a gradient on to its
        inputs (``_unit_backward_done``). Hooks on the graph, as FSDP2's, not torch's full
        backward hooks on the module: those wrap its inputs and outputs in views (an in-place
        change of its output, ``ReLU(inplace=True)`` or a residual ``out += x``, was refused)
        and add nodes to the graph (gradients summed in another order). Nothing is hooked on a
        leaf tensor, whose hooks would outlive the graph."""
        self._release_after_forward(index)
        starts = self._starts.get((threading.get_ident(), index))
        start = starts.pop() if starts else None
        if start is None or output is None or not torch.is_grad_enabled():
            return
        end = _next_sequence_nr()  # (numbers are per thread: nodes outside [start, end) are not this forward's)
        computed = [t for t in _needing_grad(output) if t.grad_fn is not None]
        roots = [node for node in (t.grad_fn for t in computed) if node is not None and start <= node._sequence_nr() < end]
        if not roots:
            return
        torch.autograd.graph.register_multi_grad_hook(computed, partial(self._hold_for_backward, index), mode="any")
        edges, accumulators = _edge_nodes(roots, start, end, self._weight_of)
        done = _UnitBackward(len(edges), partial(self._unit_backward_done, index, accumulators))
        for node in edges:
            node.register_hook(done)

    def _hold_for_backward(self, index: int, _: Any) -> None:
        self._hold(index)

    def _hold(self, index: int, forward: bool = False) -> None:
        """Hold the unit's weights on the device tier (one round trip to the loop for all).
        A forward inside backward is a checkpoint recomputing the unit: its frozen weights
        are lent as private copies instead (see ``_lend``)."""
        self._order.append(index)
        self._prefetch_after(len(self._order) - 1, index)
        weights = self._units[index].weights
        if forward and _in_backward():
            frozen = [w for w in weights if not w.param.requires_grad]
            weights = [w for w in weights if w.param.requires_grad]
            self._lend(index, frozen)
            if weights:
                self._recomputing.add(index)
        self._hold_weights(weights, index)

    def _lend(self, index: int, weights: list[_Weight]) -> None:
        """A checkpoint recomputes the unit: what its forward saves is kept by the checkpoint
        (torch's own saved-tensor hooks, not ours) until the region's backward used it, and
        would refer to the weights it computed with. Frozen weights get no gradient whose
        accumulation would tell when that is, so the unit computes with a copy of each that
        autograd owns (freed when the nodes that saved it ran, as an activation) and the
        store's hold ends at once. The parameter keeps its copy until the unit's backward is
        done (``_unit_backward_done``, or the backward's end): torch's checkpoint saves a frozen leaf
        parameter as the parameter itself (not a detached alias), checks what it recomputed
        against the forward's (shapes), and reads it when the node runs."""
        if not weights:
            return
        fresh = [w for w in weights if w.borrowers == 0]
        self._hold_weights(fresh, _LENDER)
        for weight in fresh:
            weight.lent = weight.param.data.clone()
            weight.holders.discard(_LENDER)
        for weight in weights:
            weight.borrowers += 1
            weight.param.data = weight.lent  # type: ignore[assignment]
        self._let_go(fresh)  # after the copies (the release waits for the kernels queued so far)
        self._lent.setdefault(index, []).append(weights)

    def _give_back(self, index: int) -> None:
        """The recomputed unit's backward is done: its parameters no longer show their copies
        (what autograd still keeps of them stays alive as long as it needs them)."""
        for weight in self._lent[index].pop():
            weight.borrowers -= 1
            if weight.borrowers == 0:
                weight.lent = None
                if _REGISTRY.get(weight.param) is None:
                    continue  # put back in place (detach() or a close during this backward): left as it is
                weight.param.data = weight.value if weight.hold is not None else _placeholder(weight.param)  # type: ignore[assignment]
                weight.version = weight.held_version = weight.param._version
        if not self._lent[index]:
            del self._lent[index]

    def _give_back_all(self) -> None:
        """``_give_back`` of every copy still lent (no backward that could use them runs)."""
        for index in list(self._lent):
            while self._lent.get(index):
                self._give_back(index)

    def _note_backward(self, holder: int) -> None:
        """A backward holds ``holder``'s weights: they are let go when it ends at the latest
        (a frozen weight gets no gradient, whose accumulation would let go of it)."""
        task = torch._C._current_graph_task_id()
        units = self._in_backward.get(task)
        if units is None:
            units = self._in_backward[task] = set()
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(task))
        units.add(holder)

    def _unit_backward_done(self, index: int, accumulators: dict[int, Any]) -> None:
        """The unit's backward passed a gradient on to one of its inputs: its frozen weights,
        which no gradient accumulation lets go of, are let go now, and so are trainable ones
        whose gradient this backward does not accumulate (``autograd.grad`` with respect to the
        input alone: they stayed held to its end, all together). A unit whose inputs need no
        gradient gets no call: the backward's end lets go of its weights. What a checkpoint's recomputation saved
        refers to copies of its frozen weights (``_lend``), not to these holds, but to its
        trainable weights' buffers: those stay held. A use after this (a frozen weight feeding
        another's gradient) holds it again."""
        if self._lent.get(index):
            self._give_back(index)
        recomputed = index in self._recomputing

        def done_with(weight: _Weight) -> bool:
            if not weight.param.requires_grad:
                return True
            accumulator = accumulators.get(id(weight.param))
            return not recomputed and accumulator is not None and not _accumulates(accumulator)

        weights = [w for w in self._units[index].weights if index in w.holders and done_with(w)]
        for weight in weights:
            weight.holders.discard(index)
        self._let_go(weights)

    def _end_backward(self, task: int) -> None:
        """A backward ended: what it held is no longer needed by it, nor the copies lent for
        its recomputations (a unit whose inputs needed no gradient gets no ``_unit_backward_done``)."""
        for index in self._in_backward.pop(task, ()):
            weights = [w for w in self._units[index].weights if index in w.holders]
            for weight in weights:
                weight.holders.discard(index)
            self._let_go(weights)
            self._recomputing.discard(index)
        if not self._in_backward:
            self._give_back_all()

    def _hold_weights(self, weights: list[_Weight], holder: int) -> None:
        if self._detached:  # (a backward through a forward made before detach(): the weights are in place)
            return
        started = time.perf_counter()
        todo = [w for w in weights if w.hold is None]
        _check_unchanged(todo)
        for weight in todo:
            self._hook_gradient(weight)
        if _in_backward() and holder != _LENDER:
            self._note_backward(holder)
        if todo:
            managers = [self.store.hold(w.key, self.device_tier) for w in todo]
            try:
                values = run(_enter_all(managers))
            except TierFullError as error:
                recomputed = [
                    i for i in sorted(self._recomputing) if any(i in w.holders and w.param.requires_grad for w in self._units[i].weights)
                ]
                if not recomputed:
                    raise
                names = ", ".join(self._units[i].name for i in recomputed)
                raise TierFullError(
                    f"{error}; a checkpoint (torch.utils.checkpoint) is recomputing units {names} in backward: what the "
                    f"recomputation saves refers to their trainable weights' buffers on the device tier {self.device_tier!r}, "
                    f"so the trainable weights of a checkpointed region stay held there together until their gradients "
                    f"are accumulated (frozen weights are copied and let go at once); checkpoint smaller regions, freeze "
                    f"more of the region, or give the device tier more room"
                ) from error
            for weight, manager, value in zip(todo, managers, values, strict=True):
                weight.hold = manager
                weight.value = _laid_out(value if value.device == weight.param.device else value.to(weight.param.device), weight.stride)
                if not weight.borrowers:  # (a recomputation computes with its copy)
                    weight.param.data = weight.value
                    weight.held_version = weight.param._version
            ended = time.perf_counter()
            self.report.add_stall(started, ended)
            self.report.add_moved(sum(v.nbytes for v in values), ended - started, out=False)
        for weight in weights:
            weight.holders.add(holder)

    def _release_after_forward(self, index: int) -> None:
        """After the unit's forward. A forward that runs inside backward is a checkpoint
        recomputing it (``torch.utils.checkpoint``): what it saved for backward are plain
        aliases of the held trainable weights (the checkpoint's hooks, not ours, packed
        them), and its backward follows at once, so those stay held until their gradients
        are accumulated, as when backward reaches a unit; its frozen weights keep their copies
        until its backward is done (``_lend``)."""
        if not _in_backward():
            self._release(index)

    def _release(self, index: int) -> None:
        """The unit is done computing (its forward ended, or raised)."""
        weights = self._units[index].weights
        for weight in weights:
            weight.holders.discard(index)
        self._let_go(weights)

    def _let_go(self, weights: list[_Weight], everyone: bool = False) -> None:
        """Put placeholders back for those of ``weights`` no unit holds (``everyone``: whoever
        held them) and end their holds on the loop once the kernels queued so far, which may
        still read the weights, are done (``link.mark()`` here, on the training thread). A
        weight changed in place while held is stored first (``_store_changes``)."""
        going = []
        for weight in weights:
            if everyone:
                weight.holders.clear()
            if weight.hold is not None and not weight.holders:
                going.append(weight)
        try:
            self._store_changes(going)
        finally:
            managers = []
            for weight in going:
                # (not while a recomputation computes with its copy, nor once put back in place)
                if not weight.borrowers and _REGISTRY.get(weight.param) is not None:
                    weight.param.data = _placeholder(weight.param)
                    weight.version = weight.param._version
                managers.append(weight.hold)
                weight.hold = weight.value = None
            if managers:
                marker = self.link.mark()
                self._releasing = [f for f in self._releasing if not f.done()]
                exiting = _exit_after(self.store, self.device_tier, self.link, marker, managers)
                self._releasing.append(asyncio.run_coroutine_threadsafe(exiting, self._loop))

    def _store_changes(self, weights: list[_Weight]) -> None:
        """Store those of ``weights`` a unit changed in place while it held them
        (``_store_changed``), the training thread waiting for it."""
        changed = self._changed(weights)
        if changed:
            run(self._store_changed(changed, self.link.mark()))  # (the copies follow the kernels that made the change)

    @staticmethod
    def _changed(weights: list[_Weight]) -> list[_Weight]:
        """Those of the held ``weights`` whose version counter moved since their buffer went in
        (a recomputation's copy aside)."""
        # (asked at every release: the version compare, cheapest and nearly always false, first)
        return [w for w in weights if w.param._version != w.held_version and not w.borrowers and w.value is not None
                and _REGISTRY.get(w.param) is not None]

    async def _store_changed(self, changed: list[_Weight], marker: Any) -> None:
        """Store the held values of ``changed``, as the plain module keeps a change its forward
        makes in place (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, under
        ``no_grad``), before the holds on the old value's buffers end, so any later read, hold
        or optimizer update sees it (the optimizer, seeing the version move, reloads its master
        from the stored weight, as torch's AdamW updates the changed weight). On a memory tier
        the change is written over the stored value under a write hold (no second copy needs
        room); on the disk tier it is put."""
        in_place = isinstance(self.store.tier(self.tier), MemoryTier) and self.tier != self.device_tier
        for weight in changed:
            value = weight.value
            assert value is not None
            try:
                if in_place:
                    async with self.store.hold(weight.key, self.tier, write=True) as stored:
                        await self.link.to_host(stored, value, after=marker)
                else:
                    await to_store(self.store, weight.key, value.contiguous(), self.tier, self.link, marker)
            except Exception as exc:
                exc.add_note(
                    f"(storing parameter {weight.key.rsplit('/', 1)[-1]!r} (stored as {weight.key!r}), which a forward changed "
                    "in place while it was held, e.g. nn.Embedding(max_norm=...): that change is lost)"
                )
                raise
            weight.held_version = weight.param._version
            self.report.bytes_out += value.nbytes

    def _prefetch_after(self, position: int, index: int) -> None:
        """Prefetch the units that follow, in last step's order (or, in the first step, the
        next ones in module order), within ``ahead`` bytes (and a quarter of the device tier).
        Each unit is asked for once per pass: a cursor remembers how far requests went."""
        if self._detached:
            return
        following: list[tuple[int | None, int]]
        if self._learned and position + 1 < len(self._learned):
            following = list(enumerate(self._learned[position + 1 :], start=position + 1))
        else:  # the first step: the next units in module order (no cursor: positions unknown)
            following = [(None, i) for i in range(index + 1, len(self._units))]
        keys, budget = [], min(self.ahead, self.store.tier(self.device_tier).capacity // 4)
        for where, nxt in following:
            unit = self._units[nxt]
            if unit.nbytes > budget:
                break
            budget -= unit.nbytes
            if where is not None and where < self._cursor:
                continue  # already requested in this pass
            keys += [w.key for w in unit.weights]
            if where is not None:
                self._cursor = max(self._cursor, where + 1)
        if keys:
            self._loop.call_soon_threadsafe(_start_prefetch, self.store, keys, self.device_tier)
            self.report.prefetched += len(keys)

    def mark_step(self) -> None:
        """End of a training step: this step's order of units becomes next step's prefetch order."""
        if self._order:
            self._learned, self._order = self._order, []
        self._cursor = 0

    # -- state_dict and load_state_dict ------------------------------------------------------------

    def _own_weights(self, module: nn.Module, prefix: str, state_dict: dict[str, Any]) -> list[tuple[str, _Weight]]:
        """``(state_dict key, weight)`` for ``module``'s own offloaded parameters in ``state_dict``."""
        found = []
        for name, param in module._parameters.items():
            weight = self._weight_of.get(id(param)) if param is not None else None
            if weight is not None and weight.param is param and prefix + name in state_dict and offloaded(param) is not None:
                found.append((prefix + name, weight))
        return found

    @property
    def _reading(self) -> list[_Reading]:
        """This thread's ``state_dict()`` calls in progress, innermost last (calls from two
        threads at once must not end each other's)."""
        calls: list[_Reading] | None = getattr(self._reading_here, "calls", None)
        if calls is None:
            calls = self._reading_here.calls = []
        return calls

    def _state_dict_enter(self, module: nn.Module, prefix: str) -> None:
        """``module.state_dict()`` starts: a new call unless torch recurses into a child of the
        module the innermost call entered last. A call that raised left its modules entered:
        it is dropped once none of its modules' ``state_dict()`` still runs."""
        running = _running_state_dicts()[1:]  # (the first is this module's own)
        while self._reading and not any(m is self._reading[-1].entered[-1][0] for m in running):
            self._reading.pop()
        if self._reading:
            parent, at = self._reading[-1].entered[-1]
            if any(child is module and prefix == f"{at}{name}." for name, child in parent._modules.items()):
                self._reading[-1].entered.append((module, prefix))
                return
        self._reading.append(_Reading([(module, prefix)]))

    def _seen_in(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """What this ``load_state_dict`` has written so far (tied weights)."""
        ref = self._in_dict[0]
        if ref is None or ref() is not state_dict:
            try:
                self._in_dict = (weakref.ref(state_dict), {})
            except TypeError:  # a destination that cannot be weakly referenced: no sharing
                return {}
        return self._in_dict[1]

    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, unit: bool) -> None:
        """``module.state_dict()`` gets the weights from the store (on each parameter's device,
        in its dtype and shape, as ``detach()`` puts them back) instead of the zero-size
        placeholders. ``keep_vars=True`` keeps the Parameter objects themselves (that is what
        it asks for): outside a forward their data is the placeholder. Each call reads anew
        (a ``destination`` given again gets the current weights)."""
        try:
            if unit:
                self._read_into(module, state_dict, prefix)
        finally:
            entered = self._reading[-1].entered if self._reading else []
            if entered and entered[-1][0] is module and entered[-1][1] == prefix:
                entered.pop()
                if not entered:  # the call ends: what it read is the caller's alone
                    self._reading.pop()

    def _read_into(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        todo = [(key, weight) for key, weight in self._own_weights(module, prefix, state_dict) if state_dict[key] is not weight.param]
        if not todo:
            return
        _check_unchanged([weight for _, weight in todo if weight.hold is None])
        seen = self._reading[-1].read if self._reading else {}
        values = {w.key: value for _, w in todo if w.key in seen and (value := seen[w.key]()) is not None}
        wanted = list({w.key: w for _, w in todo if w.key not in values}.values())
        if wanted:
            for weight, value in zip(wanted, run(self._read_all(wanted)), strict=True):
                values[weight.key] = value
                seen[weight.key] = weakref.ref(value)
        for key, weight in todo:
            state_dict[key] = values[weight.key]

    async def _read_all(self, weights: list[_Weight]) -> list[torch.Tensor]:
        values = []
        for weight in weights:
            param = weight.param
            if self.link.lends:
                value = (await self.store.read(weight.key)).to(param.device)
            else:
                value = await to_device(self.store, weight.key, param.device, self.link)
            values.append(_laid_out(value.to(param.dtype).view(weight.shape), weight.stride))
        return values

    def _load_state_dict_hook(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """``module.load_state_dict()`` writes the given weights into the store. Each offloaded
        parameter's entry in torch's copy of the dict is then the parameter itself, so torch's
        own copy (or ``assign=True``) leaves the placeholder as it is, and its key, missing and
        unexpected, counts as usual. A shape mismatch is reported in torch's words.
        ``assign=True`` is refused: torch copies nothing then, so an optimizer keeping its own
        master would not see the load and would write its stale master over it."""
        if local_metadata.get("assign_to_params_buffers") and any(True for _ in self._own_weights(module, prefix, state_dict)):
            raise ValueError(
                "load_state_dict(assign=True) on a module under offload_parameters: its weights live in the store; "
                "load without assign= (the store takes the values), or detach() first"
            )
        writes = []
        for key, weight in self._own_weights(module, prefix, state_dict):
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                continue  # torch reports it
            if len(weight.shape) == 0 and tuple(value.shape) == (1,):  # as torch: a 0.3-era scalar
                value = value[0]
            if value.shape != weight.shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                    f"the shape in current model is {weight.shape}."
                )
            else:
                writes.append((weight, value))
            state_dict[key] = weight.param
            self._loading[weight] = (weight.param._version, False)
        if writes:
            self._write_all(writes, self._seen_in(state_dict))
            for weight, _ in writes:
                self._loading[weight] = (weight.param._version, True)

    def _loaded(self, module: nn.Module) -> None:
        """After torch's load of ``module``: its copy into each covered placeholder (a no-op)
        counted as an in-place change, which was not one. A weight the load wrote is changed
        by it; one it did not write keeps what the user did to it before (the next forward
        still refuses an in-place change it did not replace)."""
        for param in module._parameters.values():
            weight = self._weight_of.get(id(param)) if param is not None else None
            if weight is None or weight not in self._loading:
                continue
            before, written = self._loading.pop(weight)
            now = weight.param._version
            weight.version = now if written else weight.version + now - before

    def _write_all(self, writes: list[tuple[_Weight, torch.Tensor]], seen: dict[str, Any]) -> None:
        self._forget_aborted(threading.get_ident(), CallSite.here())
        if any(entry.hooks is not None for entry in self._saving):
            raise RuntimeError("load_state_dict() during a forward of a module under offload_parameters: load between steps")
        writes = [(w, v) for w, v in writes if seen.get(w.key) is not v]  # a tied weight's second name, same tensor
        if not writes:
            return
        # Holds left from a backward (a frozen unit's) end first: the store then takes the new value.
        self._let_go([w for w, _ in writes], everyone=True)
        for releasing in self._releasing:
            releasing.result()
        self._releasing = []
        sources = [value.detach().to(device=w.param.device, dtype=w.param.dtype).contiguous() for w, value in writes]
        marker = self.link.mark()  # the copies follow the kernels that made the sources
        run(self._store_values([w for w, _ in writes], sources, marker))
        for weight, value in writes:
            seen[weight.key] = value

    async def _store_values(self, weights: list[_Weight], sources: list[torch.Tensor], marker: Any) -> None:
        for weight, source in zip(weights, sources, strict=True):
            await to_store(self.store, weight.key, source, self.tier, self.link, marker)

    # -- for the optimizer ----------------------------------------------------------------------------------

    def shape_of(self, key: str) -> torch.Size:
        """The shape of the parameter stored under ``key``."""
        for weight in self._weights:
            if weight.key == key:
                return weight.shape
        raise KeyError(key)

    async def read_weight(self, key: str) -> torch.Tensor:
        """A parameter's current value as a CPU tensor."""
        return await self.store.read(key)

    async def write_weight(self, key: str, value: torch.Tensor) -> None:
        """Store a parameter's new value (the optimizer calls this after its update)."""
        await self.store.put(key, value, tier=self.tier)

    def range_tier(self) -> str:
        """The memory tier a part of a weight is read or written on: ``tier`` if it is one,
        else the slowest memory tier (the weight is held there, never copied whole)."""
        if isinstance(self.store.tier(self.tier), MemoryTier):
            return self.tier
        return [t.name for t in self.store.tiers if isinstance(t, MemoryTier)][-1]

    async def read_weight_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of a flattened parameter, as a CPU tensor of their own."""
        async with self.store.hold(key, self.range_tier()) as weight:
            part = weight.reshape(-1)[start:stop]
            return part.to("cpu", copy=True)

    async def write_weight_range(self, key: str, start: int, value: torch.Tensor) -> None:
        """Write ``value`` over elements ``start:`` of a flattened parameter in the store (the
        optimizer updates a large parameter chunk by chunk)."""
        async with self.store.hold(key, self.range_tier(), write=True) as weight:
            weight.reshape(-1)[start : start + value.numel()].copy_(value.reshape(-1))


#: The holder of a frozen weight's hold while a copy of it is made (``_lend``).
_LENDER = -1


def _check_unchanged(weights: list[_Weight]) -> None:
    """Refuse to go on after an in-place change of a placeholder, or a cast of it (``.double()``,
    ``.half()``, ``.to(dtype)`` of the module): it changed nothing stored."""
    for weight in weights:
        if weight.param.dtype != weight.dtype:
            raise RuntimeError(
                f"parameter {weight.key.rsplit('/', 1)[-1]!r} (stored as {weight.key!r}) was cast to {weight.param.dtype} while "
                f"offloaded (module.double(), .half(), .to(dtype)); its stored weight is {weight.dtype}, and computing with it "
                f"would not follow the cast. detach() puts the weights back cast to {weight.param.dtype}; offload again after it "
                f"(or cast a module before offload_parameters)"
            )
        if weight.param._version != weight.version:
            raise RuntimeError(
                f"parameter {weight.key.rsplit('/', 1)[-1]!r} (stored as {weight.key!r}) was changed in place while offloaded (e.g. p.mul_() under torch.no_grad()): "
                f"between forwards its data is a size-0 placeholder and the weight lives in the store, so the change was lost; "
                f"change offloaded weights with load_state_dict() (or after ParameterOffload.detach())"
            )


def _running_state_dicts() -> list[Any]:
    """The modules whose ``nn.Module.state_dict`` runs on this thread now, innermost first."""
    code = nn.Module.state_dict.__code__
    modules = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            modules.append(frame.f_locals.get("self"))
        frame = frame.f_back  # type: ignore[assignment]
    return modules


def _needing_grad(value: Any) -> list[torch.Tensor]:
    """The tensors requiring a gradient in ``value`` (nested tuples, lists and dicts, such as
    a model output), each once."""
    found: dict[int, torch.Tensor] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.setdefault(id(item), item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
    return list(found.values())


_PROBE = torch.empty(0, requires_grad=True)


def _next_sequence_nr() -> int:
    """The sequence number autograd gives the next node made on this thread (numbers grow)."""
    node = _PROBE.view(0).grad_fn
    assert node is not None
    return int(node._sequence_nr()) + 1


def _edge_nodes(roots: list[Any], start: int, end: int, weights: dict[int, Any]) -> tuple[list[Any], dict[int, Any]]:
    """The nodes of a unit's part of the graph (made between sequence numbers ``start`` and
    ``end``, reached from ``roots``) that pass a gradient on outside it: to a node made before, or to
    a leaf that is not a stored weight (an input); and the stored weights' gradient
    accumulators it reaches, by the weight's ``id``."""
    edges, stack, seen = [], list(roots), set()
    accumulators: dict[int, Any] = {}
    visited = []  # (kept alive while walking: a freed wrapper's id could come back for another node)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)
        outward = False
        for following, _ in node.next_functions:
            if following is None:
                continue
            if hasattr(following, "variable"):  # (AccumulateGrad: a leaf)
                if id(following.variable) in weights:
                    accumulators[id(following.variable)] = following
                else:
                    outward = True
            elif start <= following._sequence_nr() < end:
                stack.append(following)
            else:
                outward = True
        if outward:
            edges.append(node)
    return edges, accumulators


def _accumulates(accumulator: Any) -> bool:
    """Whether the running backward accumulates into the leaf of ``accumulator`` (not so
    under ``autograd.grad``, nor ``backward(inputs=...)`` without it)."""
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:  # (torch refuses to say for a leaf under autograd.grad, which accumulates nothing)
        return False


class _UnitBackward:
    """A post-hook of each of a unit's ``edges`` nodes: calls ``action`` once in each backward
    pass (graph task), once all of them have run (the first alone is too early: a residual
    inside the unit passes its gradient out before the nodes that read its weights). Where some
    edge does not run (``backward(inputs=...)``), the backward's end lets go instead. It keeps
    no node: a node's hook referring to nodes would be a cycle the collector cannot see."""

    def __init__(self, edges: int, action: Callable[[], None]) -> None:
        self._edges = edges
        self._action = action
        self._task: int | None = None
        self._waiting = 0

    def __call__(self, *_: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._waiting = self._edges
        self._waiting -= 1
        if self._waiting == 0:
            self._action()


#: Folders of torch's and this package's code (``CallSite`` looks past their frames).
_INTERNAL = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parents[1]) + os.sep)


@dataclass(frozen=True)
class CallSite:
    """Where in this thread's code something runs, as the nearest frame outside torch and this
    package (the code that called the module, or ``detach()``; the same whatever wrappers torch
    adds, ``torch.compile``'s): how deep it is in the stack, that frame's identity and the
    instruction it is at. No reference to the frame is kept (it would keep its locals alive)."""

    depth: int
    frame: int
    instruction: int

    @staticmethod
    def here() -> CallSite:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
            frame = frame.f_back
        if frame is None:
            return CallSite(0, 0, -1)
        return CallSite(_depth_of(frame), id(frame), frame.f_lasti)

    def inside(self, earlier: CallSite) -> bool:
        """Whether code here runs inside the call made at ``earlier`` (it is still running): the
        frame ``earlier`` names is below this one in the stack, still at that instruction. A
        call ended and made again from the same place (the next step) is at the same depth."""
        if self.depth <= earlier.depth:
            return False
        frame: FrameType | None = sys._getframe(1)
        depth = _depth_of(frame)  # type: ignore[arg-type]
        while frame is not None and depth > earlier.depth:
            frame, depth = frame.f_back, depth - 1
        return frame is not None and id(frame) == earlier.frame and frame.f_lasti == earlier.instruction


def _depth_of(frame: FrameType) -> int:
    depth = 0
    current: FrameType | None = frame
    while current is not None:
        depth += 1
        current = current.f_back
    return depth


def _top_saved_tensor_hooks() -> Any:
    """The saved-tensor hooks on top of this thread's stack (torch's ``(pack, unpack)``), or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def pop_abandoned_hooks(kept: tuple[Any, Any]) -> None:
    """Pop the saved-tensor hooks a parameter offload pushed for a forward that ended without
    its forward hook (a ``KeyboardInterrupt``) while they sit above ``kept`` (another ``with``
    block's, about to be popped by its own exit, which pops whatever is on top)."""
    _pop_saved_tensor_hooks_while(lambda top: top != kept and isinstance(_hooks_of(top[0]), _WeakSavedHooks))


def _pop_saved_tensor_hooks_while(popping: Callable[[tuple[Any, Any]], bool]) -> None:
    """Pop this thread's top saved-tensor hooks for as long as ``popping(top)`` says so."""
    top = _top_saved_tensor_hooks()
    while top is not None and popping(top):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        top = _top_saved_tensor_hooks()


def _hooks_of(pack: Any) -> Any:
    """The object whose bound method ``pack`` is, through a ``torch.compiler.disable`` wrapper."""
    return getattr(getattr(pack, "__wrapped__", pack), "__self__", None)


class _WeakSavedHooks:
    """The saved-tensor hooks a parameter offload pushes for each forward, holding it weakly.

    A forward that never ended (Ctrl-C: torch runs no ``always_call`` hook for a
    ``KeyboardInterrupt``) leaves them on its thread's stack, which only that thread can pop.
    Held strongly, they kept the offloader, and its module, alive for good, and a store closed
    meanwhile sent every later saved tensor of that thread through them. Now an offloader
    dropped, detached or closed is let go, and its hooks, at their next call, pass the tensor
    on as torch would and take themselves off the stack. What backward needs of the offloader,
    a saved ``_ParamRef`` holds."""

    def __init__(self, offload: ParameterOffload) -> None:
        self._offload = weakref.ref(offload)

    def pack(self, tensor: torch.Tensor) -> Any:
        offload = self._offload()
        if offload is not None and not offload._detached:
            return offload._pack(tensor)
        top = _top_saved_tensor_hooks()
        if top is not None and _hooks_of(top[0]) is self:  # (it is: torch calls the top's)
            torch._C._autograd._pop_saved_tensors_default_hooks()
            below = _top_saved_tensor_hooks()
            if below is not None:  # (a with block entered before the aborted forward: what torch calls now)
                return _PackedBelow(below[0](tensor), below[1])
        return kept(tensor)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _ParamRef):
            return packed.owner._unpack_param(packed)
        if isinstance(packed, _Saved):
            return packed.owner._unpack(packed)
        if isinstance(packed, _PackedBelow):
            return packed.unpack(packed.packed)
        return packed


@dataclass(eq=False, slots=True)
class _PackedBelow:
    """What the saved-tensor hooks below an abandoned pair packed (``_WeakSavedHooks.pack``),
    with the unpack hook that reads it back."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


class _Hook:
    """A hook offload_parameters puts on the module: a module pickled or deep-copied whole
    (``torch.save(model)``, ``copy.deepcopy``) would carry size-0 placeholders, not its weights,
    so that is refused with a way out (it failed with "Can't pickle local object")."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a module under offload_parameters cannot be pickled or deep-copied whole (torch.save(model), "
            "copy.deepcopy(model)): its weights live in the store, and its parameters hold size-0 placeholders; "
            "save model.state_dict() (which reads the stored weights), or call detach() first to put them back"
        )


def _in_backward() -> bool:
    """Whether this thread is running a backward pass (autograd's engine sets a graph task)."""
    return torch._C._current_graph_task_id() != -1


def _placeholder(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


async def _exit_after(store: TierStore, tier: str, link: Link, marker: Any, managers: list[Any]) -> None:
    """End ``managers``' holds once the work before ``marker`` has run. Its first step runs
    before any request the training thread queues after it: that request counts on the room."""
    try:
        task = asyncio.current_task()
        if task is not None:
            store._expect_room(tier, task)
        await link.when_done(marker)
    finally:
        await _exit_all(managers)


def _start_prefetch(store: TierStore, keys: list[str], tier: str) -> None:
    """On the loop: prefetch those of ``keys`` that exist and are not on ``tier`` already."""
    wanted = [key for key in keys if key in store and tier not in store.where(key)]
    if wanted:
        asyncio.ensure_future(store.prefetch(wanted, tier))


async def _enter_all(managers: list[Any]) -> list[torch.Tensor]:
    entered = await asyncio.gather(*(m.__aenter__() for m in managers), return_exceptions=True)
    failed = [e for e in entered if isinstance(e, BaseException)]
    if failed:  # let go of the ones that did enter, then report
        await _exit_all([m for m, e in zip(managers, entered, strict=True) if not isinstance(e, BaseException)])
        raise failed[0]
    return entered  # type: ignore[return-value]


async def _exit_all(managers: list[Any]) -> None:
    for manager in managers:
        await manager.__aexit__(None, None, None)


def offload_parameters(
    module: nn.Module,
    store: TierStore | SyncTierStore,
    tier: str = "host",
    device_tier: str | None = None,
    ahead: int | str = "64MiB",
    namespace: str | None = None,
    emulate_device: bool | None = None,
    whole_units: Iterable[type[nn.Module]] = (),
) -> ParameterOffload:
    """Keep ``module``'s parameters in ``store`` (``tier``: host or disk) and bring each
    submodule's onto ``device_tier`` (default: the store's fastest) only while it computes;
    their keys go into ``namespace``, claimed in the store (default: a fresh ``swap/params/<n>/``).
    ``emulate_device`` as for ``offload_activations``: the device tier's link decides, and a
    contradicting True/False raises ``ValueError``. ``whole_units``: module classes that read
    their children's weights themselves (as ``WHOLE_UNITS``, which are always whole), each
    made one unit with its children's weights: transformers' ``CLIPTextEmbeddings`` reads its
    ``position_embedding.weight.shape`` in its own forward, say."""
    return ParameterOffload(module, store, tier, device_tier, ahead, namespace, emulate_device, whole_units)

async def _put_weight_back(store: TierStore, key: str, param: torch.Tensor, link: Link, stride: tuple[int, ...] | None) -> None:
    """The stored weight ``key`` back into ``param`` (its placeholder's device and dtype, with
    ``stride``, its strides when offloaded: ``_Weight.stride``), over ``link``; ``param`` is no
    longer offloaded from then on."""
    value = (await store.read(key)).to(param.device) if link.lends else await to_device(store, key, param.device, link)
    _REGISTRY.pop(param, None)  # (first: a lent copy given back from now on leaves the weight alone)
    param.data = _laid_out(value.to(param.dtype), stride)


def _layout_of(param: torch.Tensor) -> tuple[int, ...] | None:
    """``_Weight.stride`` of ``param``: its strides if it is not contiguous (those of the dense
    layout torch gives its copy, ``torch.empty_like``, for one with gaps)."""
    if param.is_contiguous():
        return None
    laid = torch.empty_like(param, device="meta")
    return None if laid.is_contiguous() else tuple(laid.stride())


def _laid_out(value: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """``value`` (a stored weight, contiguous) with ``stride``: a copy so laid out (None: itself)."""
    if stride is None or tuple(value.stride()) == stride:
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)


async def _put_back_if_alive(offloader: weakref.ref[ParameterOffload], dropped: Callable[[], Coroutine[Any, Any, bool]]) -> None:
    """The store's close hook: the weights back into a live offloader's module, or, for one
    collected meanwhile, what its finalizer does (``_release_dropped``)."""
    live = offloader()
    if live is not None:
        await live._put_back()
    else:
        await dropped()


def _release_when_dropped(store: TierStore, dropped: Callable[[], Coroutine[Any, Any, bool]], close_hook: Any) -> None:
    """The finalizer of an offloader collected without ``detach()``: ``_release_dropped`` on the
    store's loop, then its close hook removed (a long search would pile them up). It may run on
    any thread, the loop's too: nothing here waits."""
    loop = store.loop
    if loop is None or loop.is_closed() or not loop.is_running() or not store.is_open:
        return

    async def release() -> None:
        if await dropped():
            close_hook.remove()

    with contextlib.suppress(RuntimeError):  # (the loop stopped meanwhile: at exit)
        loop.call_soon_threadsafe(lambda: loop.create_task(release()))


async def _release_dropped(store: TierStore, namespace: Namespace, link: Link, weights: list[tuple[weakref.ref[torch.Tensor], str, tuple[int, ...] | None]]) -> bool:
    """For an offloader collected without ``detach()``: the weights back into those of its
    parameters something else still holds (an optimizer, a list), as ``detach()`` puts them
    back, then its namespace dropped, its weights with it. The last holds of a dropped model
    may still be ending on the loop, after their kernels: the drop waits for them, a minute at
    most (then it warns, and the store's close tries again). Returns whether it is dropped."""
    with contextlib.suppress(Exception):  # (a store closed meanwhile: nothing is left to do)
        for ref, key, stride in weights:
            param = ref()
            if param is not None and _REGISTRY.get(param) is not None:
                await _put_weight_back(store, key, param, link, stride)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while namespace.live:
        try:
            await namespace.drop()
        except EntryHeldError as error:
            if loop.time() > deadline:
                warn(f"a model dropped without ParameterOffload.detach() still holds its weights in the store after a "
                     f"minute ({error}); they stay there until the store closes", RuntimeWarning)
                return False
            await asyncio.sleep(0.01)
        except Exception:  # noqa: BLE001 - a store closed meanwhile: nothing is left to drop
            return False
    return True
