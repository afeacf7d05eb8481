"""SGLang's aux rows through a device mirror (kvplan.integrations.sglang.aux_mirror): on a GPU SGLang keeps
them in host memory beside device pools, and kvplan's engines move one memory kind. Here, on a CPU, the
setting ``aux_mirror=always`` mirrors them into another host buffer, which runs the same path: the
managers register and plan the mirror, the prefill copies each last chunk's rows into it, the decode
copies them out into SGLang's buffer before the request is reported complete."""

import types

import numpy as np
import pytest
import torch

from kvplan.errors import LayoutError
from kvplan.integrations.sglang.aux_mirror import AuxMirror, _host_rows
from kvplan.planner.contract.batch import Entry
from kvplan.transport.decode import engine_regions
from tests.integrations import sglang_sides
from tests.integrations.test_sglang_adapter import ENGINES, _manager, _run_sides  # noqa: F401 (its fixture too)
from tests.integrations.test_sglang_adapter import _free_managers  # noqa: F401
from tests.sglang_real import sglang_module


def _entries(*buffers: torch.Tensor, rows: int = 8) -> list[Entry]:
    return [Entry(b.data_ptr(), b.numel() // rows, rows) for b in buffers]


def test_a_mirror_is_made_for_host_buffers_beside_device_pools_only_or_where_asked():
    """``auto``: host buffers beside pools on a GPU (none on a CPU); ``always``: host buffers on a CPU too;
    ``never`` refuses host buffers beside device pools, naming the setting; device buffers are never mirrored."""
    host, device = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    entries = _entries(host, device)
    kinds = {host.data_ptr(): "DRAM", device.data_ptr(): "VRAM"}
    cuda = torch.device("cuda", 0)  # (not touched: these cases decide before any buffer is made)
    assert AuxMirror.for_buffers(entries, torch.device("cpu"), "auto", kinds.get) is None
    assert AuxMirror.for_buffers(entries, cuda, "auto", lambda _: "VRAM") is None
    with pytest.raises(LayoutError, match=r"buffers \[0\] are in host memory.*aux_mirror"):
        AuxMirror.for_buffers(entries, cuda, "never", kinds.get)
    mirror = AuxMirror.for_buffers(entries, torch.device("cpu"), "always", kinds.get)
    assert mirror.mirrored == (0,) and mirror.nbytes == 64
    assert mirror.entries[0].base_ptr != host.data_ptr() and mirror.entries[1] == entries[1]
    assert (mirror.entries[0].item_len, mirror.entries[0].num_items) == (8, 8)


def test_rows_go_up_before_the_plan_and_come_down_into_sglang_s_buffers_others_untouched():
    rng = np.random.default_rng(5)
    host = [torch.from_numpy(rng.integers(0, 256, 8 * n, dtype=np.uint8)) for n in (16, 4)]
    before = [t.clone() for t in host]
    mirror = AuxMirror(_entries(*host), [0, 1], torch.device("cpu"))
    views = [_host_rows(e) for e in mirror.entries]  # the mirror's rows (host memory here)
    mirror.upload([2, 5, 5, 99])  # (a row outside the buffers is left for the planner to refuse)
    for view, src in zip(views, host):
        rows = src.view(8, -1)
        assert torch.equal(view[[2, 5]], rows[[2, 5]])
        assert not view[[0, 1, 3, 4, 6, 7]].any()
    for view in views:  # what a prefill wrote into the decode's mirror
        view[6] = 7
    mirror.download([6], deadline=float("inf"))
    for src, old in zip(host, before):
        rows, old_rows = src.view(8, -1), old.view(8, -1)
        assert (rows[6] == 7).all()
        assert torch.equal(rows[[0, 1, 2, 3, 4, 5, 7]], old_rows[[0, 1, 2, 3, 4, 5, 7]])


def test_a_manager_registers_and_publishes_the_mirror_not_sglang_s_host_buffer():
    base = sglang_module("srt.disaggregation.base.conn")
    kv, aux = sglang_sides.pools(None)
    args = sglang_sides.kv_args_of(base, kv, aux)
    span = (aux.data_ptr(), aux.data_ptr() + aux.numel())
    plain = _manager(args, "DECODE")
    assert plain.aux_mirror is None and plain.side.aux[0].base_ptr == aux.data_ptr()
    mgr = _manager(args, "DECODE", kvplan_aux_mirror="always")
    assert mgr.aux_mirror is not None and mgr.decode.on_complete is not None
    assert mgr.side.aux == mgr.aux_mirror.entries and mgr.decode.side.aux[0].base_ptr != aux.data_ptr()
    assert all(end <= span[0] or start >= span[1]
               for start, end in ((a, a + n) for a, n in engine_regions(mgr.decode.side)))
    prefill = _manager(args, "PREFILL", kvplan_aux_mirror="always", max_running_requests=4, context_length=64)
    assert prefill.prefill.side.aux == prefill.aux_mirror.entries


@pytest.mark.parametrize("staged", [False, True])
def test_every_aux_row_reaches_sglang_s_decode_buffer_through_both_mirrors(monkeypatch, staged):
    """Both processes mirror their aux buffer (``KVPLAN_AUX_MIRROR=always``): the decode's own buffer stays
    zero unless the prefill's rows went up into its mirror, across, and down into it. KV, aux and every
    hybrid state kind are checked byte for byte; staged, through both staging buffers."""
    from tests.integrations.test_sglang_adapter import free_port
    from kvplan.tools.target_process import child_context, child_process

    monkeypatch.setenv("KVPLAN_AUX_MIRROR", "always")  # (the children inherit it)
    base = sglang_module("srt.disaggregation.base.conn")
    mib = 8 if staged else 0
    results, port = child_context().Queue(), free_port()
    procs = [child_process(sglang_sides.run_prefill, ENGINES[0], port, 11, results, 90.0, "hybrid", "kvplan",
                           sglang_sides.PAGES, 1, mib),
             child_process(sglang_sides.run_decode, ENGINES[0], port, 11, results, 90.0, "hybrid", None, "decode",
                           "kvplan", False, mib)]
    got = sglang_sides.gather(procs, results)
    failures, (decode_states, wrong) = got["prefill"][1], got["decode"]
    assert not any(failures.values()) and not wrong, (failures, wrong[:8])
    assert all(states[-1] == base.KVPoll.Success for states in decode_states.values()), decode_states
    assert tuple(got["prefill"][2:]) == (("staged",) if staged else ())  # (the mode of the prefill's last batch)


def test_kvplan_s_settings_take_aux_mirror():
    from kvplan.integrations.sglang.settings import Settings, SettingsError

    assert Settings.read(types.SimpleNamespace()).aux_mirror == "auto"
    assert Settings.read(None, {"KVPLAN_AUX_MIRROR": "never"}).aux_mirror == "never"
    with pytest.raises(SettingsError, match="KVPLAN_AUX_MIRROR"):
        Settings.read(None, {"KVPLAN_AUX_MIRROR": "sometimes"})


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the device mirror's CUDA path needs a GPU")


@gpu
def test_on_a_gpu_host_buffers_are_told_from_device_ones():
    from kvplan.transport.memory_kind import memory_kind

    assert memory_kind(torch.zeros(64, dtype=torch.uint8, device="cuda").data_ptr()) == "VRAM"
    assert memory_kind(torch.zeros(64, dtype=torch.uint8).data_ptr()) == "DRAM"
    assert memory_kind(torch.zeros(64, dtype=torch.uint8).pin_memory().data_ptr()) == "DRAM"


@gpu
def test_on_a_gpu_rows_go_up_on_the_caller_s_stream_and_come_down_on_the_mirror_s_own():
    rng = np.random.default_rng(6)
    host = [torch.from_numpy(rng.integers(0, 256, 8 * n, dtype=np.uint8)) for n in (16, 4)]
    mirror = AuxMirror.for_buffers(_entries(*host), torch.device("cuda", 0), "auto")
    assert mirror.mirrored == (0, 1)
    device_rows = [mirror._mirror[i] for i in mirror.mirrored]
    mirror.upload([1, 6])
    torch.cuda.current_stream().synchronize()
    for rows, src in zip(device_rows, host):
        assert torch.equal(rows[[1, 6]].cpu(), src.view(8, -1)[[1, 6]]) and not rows[[0, 2, 3, 4, 5, 7]].any()
        rows[3] = 9  # what a prefill wrote into the decode's mirror
    torch.cuda.current_stream().synchronize()
    mirror.download([3], deadline=float("inf"))
    assert all((src.view(8, -1)[3] == 9).all() for src in host)
