import pytest
import torch
from host_sync import HostSyncCounter


@pytest.mark.parametrize(
    ("read", "kind"),
    [
        (lambda t: t.sum().item(), "item"),
        (lambda t: float(t.sum()), "item"),
        (lambda t: bool(t.sum() > 0), ("bool", "item")),  # is_nonzero, or item where it decomposes
        (lambda t: t.tolist(), "tolist"),
        (lambda t: t.cpu(), "cpu"),
        (lambda t: t.numpy(), "numpy"),
        (lambda t: t[t > 0], "boolean-mask index"),
        (lambda t: torch.nonzero(t), "nonzero"),
        (lambda t: t.masked_select(t > 0), "masked_select"),
        (lambda t: torch.linalg.solve(torch.eye(4) + t[:4, None], torch.ones(4, 1)), "linalg error check"),
        (lambda t: torch.linalg.cholesky(torch.eye(4)), "linalg error check"),
        (lambda t: torch.equal(t, t), "equal"),
        (lambda t: torch.tensor([1.0, 0.0], device=t.device), "host data to device"),
        (lambda t: torch.as_tensor(0.5, dtype=t.dtype, device=t.device), "host data to device"),
        (lambda t: t.new_tensor([1.0, 0.0]), "host data to device"),  # on t's device
        (lambda t: torch.tensor([1.0, 0.0]).to(t.device), "host tensor to device"),
        (lambda t: torch.as_tensor([1, 0]).to(t), "host tensor to device"),
        (lambda t: torch.tensor([1.0, 0.0]).to(device=t.device, dtype=t.dtype), "host tensor to device"),
        (lambda t: torch.tensor([1.0, 0.0], device="cpu").to(t.device), "host tensor to device"),
    ],
)
def test_each_kind_of_host_read_counts_once(read, kind):
    t = torch.randn(8)
    with HostSyncCounter() as syncs:
        read(t)
    assert syncs.count == 1, syncs.report()
    assert syncs.syncs[0].kind.startswith(kind if isinstance(kind, tuple) else (kind,))
    assert "test_host_sync.py" in syncs.syncs[0].where[0]


def test_device_side_work_counts_none():
    a, b = torch.randn(6, 16, 4), torch.randn(6, 16, 4)
    with HostSyncCounter() as syncs:
        gram = a.mT @ b  # (6, 4, 4)
        x, info = torch.linalg.solve_ex(gram + 4 * torch.eye(4), torch.ones(6, 4, 1))
        L, info = torch.linalg.cholesky_ex(a.mT @ a)
        ok = torch.isfinite(x).all(dim=(-2, -1))
        torch.where(ok[:, None, None], x, 0.0)
        a.masked_fill_(~ok[:, None, None], 0.0)
        a[:, 0] = 1.0  # integer indexing needs no count
        torch.full((), 0.5, device=a.device)  # a fill on the device, no copy from the host
        torch.as_tensor(a, dtype=torch.float64, device=a.device)  # device data: a cast, not a copy from the host
        torch.tensor([1.0, 2.0])  # a host tensor made on the host
        torch.tensor([1.0, 2.0], device="cpu").to("cpu")  # asked for on the host, and kept there
        a.new_tensor([1.0], device="cpu")
        torch.tensor([1.0, 2.0]).to(torch.float64)  # a cast on the host
        b.to(a.device)  # device data: no copy from the host
    assert syncs.count == 0, syncs.report()


def test_counter_leaves_no_mode_behind():
    with HostSyncCounter():
        pass
    t = torch.ones(2)
    with HostSyncCounter() as outer:
        t.sum().item()
    t.sum().item()  # outside: not recorded
    assert outer.count == 1
    assert "1 host sync(s)" in outer.report()
