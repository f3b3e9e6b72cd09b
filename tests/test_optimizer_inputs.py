"""Inputs the tiered optimizers refuse or take as torch's would: float64 parameters (refused:
the state is fp32 at best, so their updates would be rounded without a word) and
``process_group=False`` (no sharding, as ``None``)."""

from __future__ import annotations

import pytest
import torch

from tierstore.optim import TieredAdamW


def test_float64_parameters_are_refused_before_anything_is_made() -> None:
    model = torch.nn.Linear(4, 4).double()
    with pytest.raises(TypeError, match="float64 parameters are not supported.*fp32"):
        TieredAdamW(model.parameters(), offload="host")


def test_a_float64_group_added_later_is_refused_and_leaves_the_groups_as_they_were() -> None:
    opt = TieredAdamW(torch.nn.Linear(4, 4).parameters(), offload="host")
    try:
        with pytest.raises(TypeError, match="float64"):
            opt.add_param_group({"params": torch.nn.Linear(2, 2).double().parameters()})
        assert len(opt.param_groups) == 1
        extra = torch.nn.Linear(2, 2)
        opt.add_param_group({"params": extra.parameters(), "lr": 1e-2})  # still usable
        assert len(opt.param_groups) == 2
    finally:
        opt.close()


@pytest.mark.device_modes
def test_process_group_false_means_no_sharding(device_mode: str) -> None:
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    exact = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    opt = TieredAdamW(model.parameters(), lr=1e-2, offload="host", process_group=False)
    try:
        for seed in range(3):
            inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
            for m, o in ((model, opt), (twin, exact)):
                m(inputs).square().mean().backward()
                o.step()
                o.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    finally:
        opt.close()


def test_two_optimizers_on_one_disk_root_are_told_how_to_share_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = TieredAdamW([torch.nn.Parameter(torch.randn(10))], offload="disk", disk_root=tmp_path / "d")
    try:
        from tierstore import StoreLockedError

        with pytest.raises(StoreLockedError, match="give each its own disk_root=, or make one TierStore"):
            TieredAdamW([torch.nn.Parameter(torch.randn(10))], offload="disk", disk_root=tmp_path / "d")
    finally:
        first.close()


def test_the_memory_plan_shows_the_chunks_made_not_the_cap_asked_for() -> None:
    param = torch.nn.Parameter(torch.randn(100_000))
    opt = TieredAdamW([param], offload="host", chunk_bytes=5000)
    try:
        plan = opt.memory_plan()
        # one block of 1,024 elements a chunk: 8 bytes of state each (moments; the fp32 parameter is
        # its own master on the plain CPU), 12 with a master copy
        assert plan.chunk_bytes in (1024 * 8, 1024 * 12)
        assert plan.chunked_parameters == 1 and f"chunks of up to {plan.chunk_bytes // 1024}.0 KiB" in str(plan)
    finally:
        opt.close()


def test_a_parameter_listed_twice_in_a_group_is_refused() -> None:
    """It was updated once per listing on the plain CPU but once on the emulated device, with
    one step count (torch warns that this will be an error; its fused and for-loop kernels
    disagree with each other too)."""
    weight = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="same parameter more than once"), pytest.warns(UserWarning):
        TieredAdamW([weight, weight])
    opt = TieredAdamW([torch.nn.Parameter(torch.ones(4))])
    with pytest.raises(ValueError, match=r"positions \[1\]"), pytest.warns(UserWarning):
        opt.add_param_group({"params": [weight, weight]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [weight]})
    weight.grad = torch.ones(4)
    opt.step()
    assert len(opt.param_groups) == 2 and float(opt.state[weight]["step"]) == 1
    opt.close()


def test_unscale_in_step_false_is_refused_with_zero_stage_2() -> None:
    """Each rank's GradScaler would check its own gradients before the reduce-scatter: one rank
    skipped its step while the other waited for it in a collective."""
    with pytest.raises(ValueError, match="unscale_in_step=False with zero_stage=2"):
        TieredAdamW([torch.nn.Parameter(torch.ones(4))], process_group=True, zero_stage=2, unscale_in_step=False)


def test_a_state_dict_of_another_model_is_refused_naming_the_parameter_and_leaves_the_state() -> None:
    model = torch.nn.Linear(4, 8)
    opt = TieredAdamW(model.parameters(), offload="host")
    try:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        before = opt.state_dict()
        other = TieredAdamW(torch.nn.Linear(5, 8).parameters(), offload="host")
        try:
            for p in other.param_groups[0]["params"]:  # (another model's state: 40 elements where ours has 32)
                p.grad = torch.ones_like(p)
            other.step()
            foreign = other.state_dict()
        finally:
            other.close()
        with pytest.raises(ValueError, match=r"parameter 0: saved 'exp_avg' has 40 elements, the parameter 32: the state dict is not this model's") as raised:
            opt.load_state_dict(foreign)
        assert "DTensor" not in str(raised.value)  # (a plain model's parameters are not DTensors)
        after = opt.state_dict()
        assert all(torch.equal(before["state"][0][name], after["state"][0][name]) for name in ("exp_avg", "exp_avg_sq"))
    finally:
        opt.close()


@pytest.mark.device_modes
@pytest.mark.parametrize("size", [7000, 100_000, 5000])
@pytest.mark.parametrize("where", ["host", "resident", "in backward"])
def test_data_of_another_size_is_refused_before_the_update(device_mode: str, size: int, where: str) -> None:
    """A tryout: ``p.data = torch.randn(7000)`` on a parameter whose state is for 6,000
    elements, then ``step()``: on the plain CPU torch's fused kernel wrote past the end of the
    smaller tensors and the process aborted ("malloc_consolidate(): invalid chunk size";
    100,000 elements: a segfault); 5,000 updated the 5,000 without a word. Now a
    ``RuntimeError`` naming the parameter, nothing changed, and the old size works again."""
    p = torch.nn.Parameter(torch.randn(6000))
    options = {"min_offload_numel": 10**6} if where == "resident" else {"step_in_backward": where == "in backward"}
    opt = TieredAdamW([p], lr=1e-2, offload="host", **options)
    try:
        for _ in range(2):
            (p * torch.randn(6000)).sum().backward()
            opt.step()
            opt.zero_grad()
        kept = p.detach().clone()
        kept_values = kept.clone()
        with torch.no_grad():
            p.data = torch.randn(size)
        with pytest.raises(RuntimeError, match=f"parameter 0 now has {size:,} elements.*state is for 6,000"):
            (p * torch.randn(size)).sum().backward()
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            p.data = kept
        (p * torch.randn(6000)).sum().backward()
        opt.step()
        assert torch.isfinite(p).all() and not torch.equal(p, kept_values)
    finally:
        opt.close()


def test_add_param_group_refuses_what_the_constructor_refuses() -> None:
    """A tryout: the constructor refuses ``capturable=True`` and ``differentiable=True``;
    ``add_param_group`` took them and ``step()`` ignored them."""
    opt = TieredAdamW(torch.nn.Linear(4, 4).parameters(), offload="host")
    try:
        for option in ({"capturable": True}, {"differentiable": True}, {"fused": True, "foreach": True}):
            with pytest.raises(ValueError, match="not supported|cannot both be True"):
                opt.add_param_group({"params": torch.nn.Linear(2, 2).parameters(), **option})
            assert len(opt.param_groups) == 1
    finally:
        opt.close()


@pytest.mark.device_modes
def test_foreach_false_runs_torchs_for_loop_kernel(device_mode: str) -> None:
    """A tryout: ``foreach=False`` ran the fused kernel (and saved ``fused=True``), where
    torch's ``foreach=False`` is its for-loop kernel: 1.2e-7 apart after 4 steps."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    twin.load_state_dict(model.state_dict())
    exact = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    opt = TieredAdamW(model.parameters(), lr=1e-2, offload="host", foreach=False, min_offload_numel=1)
    try:
        for seed in range(4):
            torch.manual_seed(seed)
            x = torch.randn(8, 64)
            for m, o in ((model, opt), (twin, exact)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(ours, theirs)
        assert opt.state_dict()["param_groups"][0]["fused"] is False
    finally:
        opt.close()


@pytest.mark.parametrize("generic", [False, True])
def test_state_dict_hooks_run_as_torchs_do(generic: bool) -> None:
    """A tryout: ``register_state_dict_pre_hook``/``_post_hook`` and the load hooks never ran
    (torch runs all four, and a post-hook's dict is the one returned)."""
    from tierstore.optim import TieredOptimizer

    model = torch.nn.Linear(4, 4)
    opt = (TieredOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, offload="host") if generic
           else TieredAdamW(model.parameters(), offload="host"))
    ran: list[str] = []
    try:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.register_state_dict_pre_hook(lambda o: ran.append("pre"))
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
        opt.register_load_state_dict_pre_hook(lambda o, sd: ran.append("load pre") or {k: v for k, v in sd.items() if k != "extra"})
        opt.register_load_state_dict_post_hook(lambda o: ran.append("load post"))
        saved = opt.state_dict()
        assert saved["extra"] == 1
        opt.load_state_dict(saved)
        assert ran == ["pre", "load pre", "load post"] and "extra" in saved  # (the pre-hook had a copy)
    finally:
        opt.close()


@pytest.mark.parametrize("optimizer_class", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_the_generic_optimizer_refuses_what_it_cannot_page(optimizer_class: type[torch.optim.Optimizer]) -> None:
    """A tryout: LBFGS was taken, then every ``step(closure)`` failed, saying to call step()
    again; SparseAdam the same."""
    from tierstore.optim import TieredOptimizer

    with pytest.raises(ValueError, match="needs a closure|sparse gradients"):
        TieredOptimizer(torch.nn.Linear(4, 4).parameters(), optimizer_class, offload="host")


@pytest.mark.parametrize("option", [{"disk_root": "somewhere"}, {"disk_capacity": "1GiB"}])
def test_disk_options_with_offload_host_are_refused(option: dict) -> None:  # type: ignore[type-arg]
    """``offload="host"`` makes no disk tier: ``disk_root=``/``disk_capacity=`` were taken and
    did nothing (a tryout), as ``store=`` with them is refused."""
    with pytest.raises(ValueError, match=f"{next(iter(option))}=.*offload='disk'"):
        TieredAdamW(torch.nn.Linear(4, 4).parameters(), offload="host", **option)


def test_a_disk_root_under_home_is_expanded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """``disk_root="~/x"`` made a folder named ``~`` in the working directory (a tryout)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(64, 64)
    opt = TieredAdamW(model.parameters(), offload="disk", disk_root="~/scratch")
    try:
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    finally:
        opt.close()
    assert not (tmp_path / "~").exists()
    assert (tmp_path / "home" / "scratch").is_dir()
