"""Key namespaces: adapters own the keys they claim; orphans of earlier runs are listed and removed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.cli import main
from tierstore.errors import InvalidKeyError, KeyNotFoundError, NamespaceClaimedError
from tierstore.optim import TieredAdamW
from tierstore.swap.activations import offload_activations
from tierstore.sync import run


def tiers(folder: Path) -> list[object]:
    """A host tier smaller than the optimizers' state, so state pages to disk and back."""
    return [HostTier("16KiB"), DiskTier(folder, "64MiB", chunk_size="64KiB")]


def sync_store(folder: Path) -> SyncTierStore:
    return SyncTierStore(tiers(folder)).open()


def gan(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    generator = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    discriminator = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return generator, discriminator


def gan_step(step: int, gen: torch.nn.Module, disc: torch.nn.Module, g_opt: torch.optim.Optimizer, d_opt: torch.optim.Optimizer) -> None:
    data = torch.Generator().manual_seed(100 + step)
    real = torch.randn(16, 16, generator=data)
    noise = torch.randn(16, 8, generator=data)
    d_opt.zero_grad()
    (disc(gen(noise).detach()).mean() - disc(real).mean()).backward()
    d_opt.step()
    disc.requires_grad_(False)
    g_opt.zero_grad()
    (-disc(gen(noise)).mean()).backward()
    g_opt.step()
    disc.requires_grad_(True)


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_two_optimizers_on_one_store_match_torch(tmp_path: Path) -> None:
    gen, disc = gan()
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    ref_g = torch.optim.AdamW(ref_gen.parameters(), lr=1e-2, fused=True)
    ref_d = torch.optim.AdamW(ref_disc.parameters(), lr=2e-2, fused=True)
    store = sync_store(tmp_path / "store")
    g_opt = TieredAdamW(gen.parameters(), lr=1e-2, store=store, min_offload_numel=16)
    d_opt = TieredAdamW(disc.parameters(), lr=2e-2, store=store, min_offload_numel=16)
    assert g_opt.namespace is not None and d_opt.namespace is not None
    assert g_opt.namespace.name != d_opt.namespace.name
    for step in range(6):
        gan_step(step, ref_gen, ref_disc, ref_g, ref_d)
        gan_step(step, gen, disc, g_opt, d_opt)
    assert_same(gen, ref_gen)
    assert_same(disc, ref_disc)
    assert store.stats()["links"].get("disk->host", {}).get("nbytes", 0) > 0  # state really paged
    mine = set(g_opt.namespace.keys())
    assert mine and mine.isdisjoint(d_opt.namespace.keys())
    g_opt.close()
    d_opt.close()
    assert store.keys() == [] or all(key.startswith("__tierstore__/") for key in store.keys())
    assert run(store.store.namespaces()) == []  # default namespaces are dropped by close()
    store.close()


def test_a_second_live_claim_raises_and_nothing_changes(tmp_path: Path) -> None:
    gen, _ = gan()
    store = sync_store(tmp_path / "store")
    first = TieredAdamW(gen.parameters(), store=store, namespace="gen", min_offload_numel=16)
    other, _ = gan(1)
    with pytest.raises(NamespaceClaimedError, match="'gen/' is claimed by 'TieredAdamW'"):
        TieredAdamW(other.parameters(), store=store, namespace="gen")
    with pytest.raises(NamespaceClaimedError, match="overlaps 'gen/'"):
        run(store.store.claim("gen/inner", owner="someone"))
    beside = run(store.store.claim("ge", owner="someone"))  # 'ge/' does not overlap 'gen/'
    run(beside.release())
    assert first.namespace is not None and first.namespace.live
    first.close()
    store.close()


def test_default_namespaces_are_unique_and_user_keys_survive(tmp_path: Path) -> None:
    store = SyncTierStore([HostTier("256KiB"), DiskTier(tmp_path / "store", "64MiB")]).open()
    store.put("optim/x", torch.arange(4.0))
    store.put("optim/0/mine", torch.arange(3.0))  # someone's key where a default would go
    models = [gan(i)[0] for i in range(3)]
    opts = [TieredAdamW(m.parameters(), store=store, min_offload_numel=16) for m in models]
    names = [opt.namespace.name for opt in opts if opt.namespace is not None]
    assert len(set(names)) == 3 and "optim/0/" not in names
    for model, opt in zip(models, opts, strict=True):
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.close()
    torch.testing.assert_close(store.get("optim/x"), torch.arange(4.0))
    torch.testing.assert_close(store.get("optim/0/mine"), torch.arange(3.0))
    assert sorted(k for k in store.keys() if not k.startswith("__tierstore__/")) == ["optim/0/mine", "optim/x"]
    store.close()


def test_named_namespace_continues_after_a_restart_as_if_uninterrupted(tmp_path: Path) -> None:
    gen, _ = gan()
    reference = copy.deepcopy(gen)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            data = torch.Generator().manual_seed(step)
            opt.zero_grad()
            model(torch.randn(8, 8, generator=data)).pow(2).mean().backward()
            opt.step()

    train(reference, ref_opt, range(8))
    store = sync_store(tmp_path / "store")
    # min_offload_numel: the weights page through the store, the biases stay in host memory.
    opt = TieredAdamW(gen.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=64)
    train(gen, opt, range(4))
    opt.close()
    store.close()

    store = sync_store(tmp_path / "store")  # a new process would see the same
    with pytest.raises(NamespaceClaimedError, match="recorded for 'TieredAdamW'"):
        run(store.store.claim("gen", owner="TieredOptimizer"))
    opt = TieredAdamW(gen.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=64)
    train(gen, opt, range(4, 8))
    assert_same(gen, reference)
    opt.close()
    store.close()


def test_overwrite_takes_over_and_stray_keys_are_not_deleted_silently(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with TierStore(tiers(tmp_path / "store")) as store:
            await store.put("gen/w", torch.ones(3))  # no namespace owns it
            with pytest.raises(NamespaceClaimedError, match="belong to no namespace"):
                await store.claim("gen", owner="a")
            assert "gen/w" in store
            old = await store.claim("old", owner="a")
            await store.put(old.key("w"), torch.ones(2))
            await old.release()
            with pytest.raises(NamespaceClaimedError, match="recorded for 'a'"):
                await store.claim("old", owner="b")
            taken = await store.claim("old", owner="b", overwrite=True)
            assert taken.keys() == [] and [n.owner for n in await store.namespaces()] == ["b"]
            with pytest.raises(NamespaceClaimedError):
                await store.claim("old", owner="b", overwrite=True)  # live: overwrite cannot take it
            await taken.drop()
            assert await store.namespaces() == []
            with pytest.raises(NamespaceClaimedError, match="released"):
                await taken.clear()

    run(scenario())


def test_reserved_keys_and_bad_names_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with TierStore([HostTier("1MiB")]) as store:
            await store.claim("a", owner="x")
            for verb in (lambda: store.put("__tierstore__/namespaces", torch.ones(1)), lambda: store.read("__tierstore__/namespaces"),
                         lambda: store.delete("__tierstore__/namespaces")):
                with pytest.raises(InvalidKeyError, match="store's own"):
                    await verb()
            for bad in ("", "/", "__tierstore__/x", "__tierstore__", 3):
                with pytest.raises(InvalidKeyError):
                    await store.claim(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                await store.claim("b", owner="")

    run(scenario())


def test_gc_lists_and_removes_orphans_of_an_earlier_run(tmp_path: Path) -> None:
    folder = tmp_path / "store"

    async def earlier_run() -> None:  # ends without releasing anything (a crash, a forgotten close)
        async with TierStore(tiers(folder)) as store:
            for _ in range(2):
                ns = await store.claim_unique("optim/", owner="TieredAdamW")
                await store.put(ns.key("0"), torch.ones(1000))
            named = await store.claim("kept", owner="TieredAdamW")
            await store.put(named.key("0"), torch.ones(10))
            await store.put("user", torch.ones(5))

    async def later_run() -> None:
        async with TierStore(tiers(folder)) as store:
            live = await store.claim_unique("optim/", owner="TieredAdamW")
            assert live.name == "optim/2/"
            listed = {n.name: n for n in await store.namespaces()}
            assert set(listed) == {"kept/", "optim/0/", "optim/1/", "optim/2/"}
            assert listed["optim/0/"].keys == 1 and listed["optim/0/"].nbytes == 4000 and not listed["optim/0/"].live
            assert listed["optim/2/"].live
            orphans = await store.gc()  # dry run by default
            assert [n.name for n in orphans] == ["optim/0/", "optim/1/"] and "optim/0/0" in store
            assert [n.name for n in await store.gc(dry_run=False)] == ["optim/0/", "optim/1/"]
            assert "optim/0/0" not in store and "kept/0" in store and "user" in store
            with pytest.raises(NamespaceClaimedError):
                await store.gc(names=["optim/2/"], dry_run=False)
            with pytest.raises(KeyNotFoundError):
                await store.gc(names=["nothing"], dry_run=False)
            await live.release()

    run(earlier_run())
    run(later_run())

    assert main(["gc", str(folder), "--dry-run"]) == 0
    assert main(["gc", str(folder)]) == 0  # the released optim/2/ (auto, empty)
    assert main(["gc", str(folder), "--name", "kept"]) == 0

    async def check() -> None:
        async with TierStore(tiers(folder)) as store:
            assert await store.namespaces() == []
            assert [k for k in store.keys() if not k.startswith("__tierstore__/")] == ["user"]

    run(check())
    assert main(["gc", str(folder), "--name", "kept"]) == 1  # no longer recorded: a clear error


def test_cli_info_lists_namespaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "store"

    async def fill() -> None:
        async with TierStore(tiers(folder)) as store:
            ns = await store.claim("gen", owner="TieredAdamW")
            await store.put(ns.key("0"), torch.ones(100))
            await store.put(ns.key("1"), torch.ones(50))

    run(fill())
    assert main(["info", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(n["name"], n["owner"], n["keys"], n["nbytes"]) for n in info["namespaces"]] == [("gen/", "TieredAdamW", 2, 600)]
    assert all(not k["key"].startswith("__tierstore__/") for k in info["keys"]) and info["entries"] == 2
    assert main(["info", str(folder)]) == 0
    assert "'gen/'" in capsys.readouterr().out


def test_swap_adapters_claim_their_own_namespaces(tmp_path: Path) -> None:
    store = SyncTierStore([HostTier("8MiB")]).open()
    first = offload_activations(store, min_bytes=0)
    second = offload_activations(store, min_bytes=0)
    assert first.namespace.name == "swap/act/0/" and second.namespace.name == "swap/act/1/"
    with pytest.raises(NamespaceClaimedError):
        offload_activations(store, namespace="swap/act/0")
    x = torch.randn(64, 64, requires_grad=True)
    with first:
        y = (x * 2).sin().sum()
    y.backward()
    first.close()
    second.close()
    assert run(store.store.namespaces()) == []
    store.close()


def test_a_named_namespace_of_other_shapes_warns_and_starts_over(tmp_path: Path) -> None:
    store = sync_store(tmp_path / "store")
    first = torch.nn.Linear(16, 16)
    opt = TieredAdamW(first.parameters(), store=store, namespace="gen", min_offload_numel=1)
    first(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.close()
    other = torch.nn.Linear(16, 8)  # same number of parameters, other shapes
    with pytest.warns(UserWarning, match="is laid out for other settings"):
        opt = TieredAdamW(other.parameters(), store=store, namespace="gen", min_offload_numel=1)
    opt.close()
    store.close()


@pytest.mark.parametrize(("saved_on", "reopened_on"), [("plain", "plain"), ("emulated", "emulated"), ("emulated", "plain"), ("plain", "emulated")])
@pytest.mark.parametrize("saved_amsgrad", [True, False])
def test_state_saved_with_the_other_amsgrad_starts_over(tmp_path: Path, saved_on: str, reopened_on: str, saved_amsgrad: bool) -> None:
    """A plain fp32 entry of three rows is the master and two moments, or (amsgrad, the
    parameter its own master) three moments. Reopened with amsgrad toggled, such state was taken
    in the other meaning without a word: exp_avg became the old exp_avg_sq. The setting is now
    saved beside the step counts, and state of the other setting starts over, with the warning
    every other change of layout gets; the next step is then the first step of torch's AdamW."""
    from tierstore.device import emulate_device

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    batches = [torch.randn(4, 16) for _ in range(3)]
    with emulate_device(saved_on == "emulated"):
        store = sync_store(tmp_path / "store")
        opt = TieredAdamW(model.parameters(), lr=1e-2, amsgrad=saved_amsgrad, store=store, namespace="gen", min_offload_numel=1)
        for x in batches[:2]:
            model.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        opt.close()
        store.close()
    reference = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, amsgrad=not saved_amsgrad, fused=True)
    with emulate_device(reopened_on == "emulated"):
        store = sync_store(tmp_path / "store")
        with pytest.warns(UserWarning, match="is laid out for other settings"):
            opt = TieredAdamW(model.parameters(), lr=1e-2, amsgrad=not saved_amsgrad, store=store, namespace="gen", min_offload_numel=1)
        assert opt.state_dict()["state"] == {}
        for m, o in ((model, opt), (reference, torch_opt)):
            m.zero_grad()
            m(batches[2]).square().sum().backward()
            o.step()
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        opt.close()
        store.close()


@pytest.mark.device_modes
@pytest.mark.parametrize("how", ["param_groups changed before close", "saved by an older tierstore"])
@pytest.mark.parametrize("saved_amsgrad", [True, False])
def test_amsgrad_toggled_another_way_still_starts_over(tmp_path: Path, device_mode: str, how: str, saved_amsgrad: bool) -> None:
    """(From review.) The flag saved was the group's setting at close(), not the one the state
    was laid out with, so toggling it in param_groups before close() saved the other meaning; and
    a namespace an older tierstore closed (no flag: simulated by deleting it) was still taken in
    the other meaning. Both now start over with the warning; an older namespace's three rows are
    taken only as this optimizer would write them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    store = sync_store(tmp_path / "store")
    opt = TieredAdamW(model.parameters(), lr=1e-2, amsgrad=saved_amsgrad, store=store, namespace="gen", min_offload_numel=1)
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
    if how == "param_groups changed before close":
        opt.param_groups[0]["amsgrad"] = not saved_amsgrad
    opt.close()
    if how == "saved by an older tierstore":
        store.delete("gen/settings")
    store.close()
    store = sync_store(tmp_path / "store")
    with pytest.warns(UserWarning, match="is laid out for other settings"):
        opt = TieredAdamW(model.parameters(), lr=1e-2, amsgrad=not saved_amsgrad, store=store, namespace="gen", min_offload_numel=1)
    assert opt.state_dict()["state"] == {}
    opt.close()
    store.close()


def test_a_namespace_saved_by_an_older_tierstore_with_the_same_settings_continues(tmp_path: Path) -> None:
    """Without the flag, state in the layout this optimizer writes is still taken."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    store = sync_store(tmp_path / "store")
    opt = TieredAdamW(model.parameters(), lr=1e-2, amsgrad=True, store=store, namespace="gen", min_offload_numel=1)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict()["state"])
    opt.close()
    store.delete("gen/settings")
    store.close()
    store = sync_store(tmp_path / "store")
    opt = TieredAdamW(model.parameters(), lr=1e-2, amsgrad=True, store=store, namespace="gen", min_offload_numel=1)
    for index, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, saved[index][name]), name
    opt.close()
    store.close()


@pytest.mark.parametrize("recorded", [True, False], ids=["settings recorded", "saved by an older tierstore"])
@pytest.mark.parametrize(("saved", "reopened"), [("8bit", "bf16"), ("bf16", "8bit")])
def test_a_small_parameter_in_another_state_precision_of_the_same_size_starts_over(
    tmp_path: Path, recorded: bool, saved: str, reopened: str
) -> None:
    """(Tryout.) 4 elements of bf16 moments and of 8-bit ones with their block scales both take
    16 bytes: reopened in the other precision, the saved bytes were read as the new format
    without a word (from 8-bit to bf16 the weights became NaN). The settings are now saved
    beside the step counts; a namespace saved without them takes a packed entry only if no
    other settings pack that many elements into as many bytes."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4))
    store = sync_store(tmp_path / "store")
    opt = TieredAdamW([param], lr=1e-2, state_precision=saved, store=store, namespace="n", min_offload_numel=1)
    for _ in range(3):
        opt.zero_grad()
        param.square().sum().backward()
        opt.step()
    opt.close()
    if not recorded:
        store.delete("n/settings")
    store.close()
    store = sync_store(tmp_path / "store")
    with pytest.warns(UserWarning, match="is laid out for other settings"):
        opt = TieredAdamW([param], lr=1e-2, state_precision=reopened, store=store, namespace="n", min_offload_numel=1)
    assert opt.state_dict()["state"] == {}
    opt.zero_grad()
    param.square().sum().backward()
    opt.step()
    assert torch.isfinite(param).all()
    opt.close()
    store.close()


def test_state_lost_from_the_store_or_never_closed_warns_and_starts_over(tmp_path: Path) -> None:
    """(Tryout.) A parameter whose saved state was lost (dropped by ``tierstore repair``) while
    its step count survived, and a namespace whose run never closed its optimizer, started over
    without a word."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)

    def train(opt: TieredAdamW) -> None:
        model.zero_grad()
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()

    store = sync_store(tmp_path / "store")
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=1)
    train(opt)
    opt.close()
    store.delete("gen/0")
    with pytest.warns(UserWarning, match=r"the saved state of parameters \[0\] is not in the store"):
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=1)
    assert sorted(opt.state_dict()["state"]) == [1]
    opt.close()
    store.close()
    crash = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_namespaces import sync_store
        from tierstore.optim import TieredAdamW
        model = torch.nn.Linear(16, 16)
        store = sync_store({str(tmp_path / "store")!r})
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=1)
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        store.flush()
        os._exit(0)  # (killed: nothing closes)
    """)
    subprocess.run([sys.executable, "-c", crash], check=True, timeout=300)
    store = sync_store(tmp_path / "store")
    with pytest.warns(UserWarning, match="holds optimizer state but no step counts"):
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=1)
    assert opt.state_dict()["state"] == {}
    opt.close()
    store.close()


@pytest.mark.device_modes
@pytest.mark.parametrize("state_precision", ["fp32", "bf16", "8bit"])
def test_a_resume_with_the_same_settings_is_silent_for_a_zero_element_parameter(tmp_path: Path, device_mode: str, state_precision: str) -> None:
    """(From review.) A parameter of no elements was taken for state of other settings on every
    resume: a warning, and its step count lost."""
    import warnings

    w, empty = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.zeros(0))

    def step(opt: TieredAdamW) -> None:
        opt.zero_grad()
        (w.square().sum() + empty.sum()).backward()
        opt.step()

    store = sync_store(tmp_path / "store")
    opt = TieredAdamW([w, empty], lr=1e-2, state_precision=state_precision, store=store, namespace="n", min_offload_numel=1)
    step(opt)
    opt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = TieredAdamW([w, empty], lr=1e-2, state_precision=state_precision, store=store, namespace="n", min_offload_numel=1)
    assert {index: int(state["step"]) for index, state in opt.state_dict()["state"].items()} == {0: 1, 1: 1}
    opt.close()
    store.close()


@pytest.mark.parametrize(("state_precision", "master_weights"), [("bf16", "fp32"), ("bf16", "lossless"), ("8bit", "fp32"), ("fp32", "lossless")])
def test_a_namespace_saved_by_an_older_tierstore_keeps_bf16_state_of_the_same_settings(
    tmp_path: Path, state_precision: str, master_weights: str
) -> None:
    """(From review.) Without the settings record, every bf16 or lossless state collided in
    size with one of another amsgrad, so a resume with unchanged settings threw it away."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(24, 24).to(torch.bfloat16)  # (a 16 KiB host tier, grads copied under the emulated device too)
    settings = {"state_precision": state_precision, "master_weights": master_weights}
    store = sync_store(tmp_path / "store")
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=1, **settings)
    model(torch.randn(4, 24, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict()["state"])
    opt.close()
    store.delete("gen/settings")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="gen", min_offload_numel=1, **settings)
    state = opt.state_dict()["state"]
    assert sorted(state) == sorted(saved)
    for index in saved:
        for name, value in saved[index].items():
            assert torch.equal(state[index][name], value), (index, name)
    opt.close()
    store.close()


@pytest.mark.device_modes
@pytest.mark.parametrize("in_backward", [False, True], ids=["after_backward", "in_backward"])
def test_optimizers_stepping_from_two_threads_on_one_store_match_torch(tmp_path: Path, in_backward: bool) -> None:
    """Two optimizers sharing a store whose host tier holds a fraction of their state, stepped at
    the same time from two threads. Each sizes its buckets by the room as if it were its own;
    stepping at once they took parts of it and waited for the rest (a hang under the emulated
    device, TierFullError on the plain CPU). Steps on one store now run one at a time; and with
    step_in_backward=True one optimizer's updates run in backward at a time, the others' in step()."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 96 + 16 * k), torch.nn.ReLU(), torch.nn.Linear(96 + 16 * k, 32)) for k in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    store = SyncTierStore([HostTier("200KiB"), DiskTier(tmp_path / "store", "64MiB", chunk_size="64KiB")]).open()
    opts = [TieredAdamW(m.parameters(), lr=1e-2, store=store, min_offload_numel=16, bucket_bytes=8192, step_in_backward=in_backward)
            for m in models]
    ref_opts = [torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True) for r in refs]
    errors: list[BaseException] = []

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
        try:
            for batch in batches:
                opt.zero_grad()
                model(batch).square().mean().backward()
                opt.step()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    batches = [[torch.randn(8, 64) for _ in range(6)] for _ in models]
    threads = [threading.Thread(target=train, args=(m, o, b), daemon=True) for m, o, b in zip(models, opts, batches, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "the steps hung"
    assert errors == []
    for ref, opt, b in zip(refs, ref_opts, batches, strict=True):
        train(ref, opt, b)
    for model, ref in zip(models, refs, strict=True):
        assert_same(model, ref)
    for opt in opts:
        opt.close()
    store.close()


@pytest.mark.device_modes
@pytest.mark.parametrize("in_backward", [(False, True), (True, True)], ids=["plain+in_backward", "both_in_backward"])
def test_one_backward_feeding_two_optimizers_on_one_store_match_torch(tmp_path: Path, in_backward: tuple[bool, bool]) -> None:
    """A GAN-like loss whose one backward gives gradients to two optimizers sharing a small store,
    the second updating in backward. Stepped one after the other, the first planned its buckets
    with the whole room while the second's updates launched in backward still held part of it:
    TierFullError (under the emulated device, on most runs). A step now waits for them first.
    Both updating in backward, each took part of the room and waited for the rest (a hang under
    the emulated device): one optimizer's updates run in backward at a time now."""
    models = []
    for k in range(2):
        torch.manual_seed(k)
        models.append(torch.nn.Sequential(torch.nn.Linear(64, 96 + 16 * k), torch.nn.ReLU(), torch.nn.Linear(96 + 16 * k, 32)))
    refs = copy.deepcopy(models)
    store = SyncTierStore([HostTier("200KiB"), DiskTier(tmp_path / "store", "64MiB", chunk_size="64KiB")]).open()
    opts = [TieredAdamW(m.parameters(), lr=1e-2, store=store, min_offload_numel=16, bucket_bytes=8192, step_in_backward=sib)
            for m, sib in zip(models, in_backward, strict=True)]
    ref_opts = [torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True) for r in refs]
    for step in range(5):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        for nets, optimizers in ((models, opts), (refs, ref_opts)):
            (nets[0](x).sum() + nets[1](x).square().mean()).backward()
            for opt in optimizers:
                opt.step()
            for opt in optimizers:
                opt.zero_grad()
    for model, ref in zip(models, refs, strict=True):
        assert_same(model, ref)
    for opt in opts:
        opt.close()
    store.close()
