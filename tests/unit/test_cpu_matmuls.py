"""The counter of matrix products on CPU tensors while a stage's device is not the CPU
(pipeline/devices.py `counting_cpu_matmuls`), what the GPU check fails a stage on."""

from __future__ import annotations

import json

import pytest
import torch

import fake_device
from conftest import TINY
from pipeline import devices


def test_cpu_products_are_counted_only_when_asked_and_only_off_the_cpu(monkeypatch):
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    monkeypatch.delenv(devices.COUNT_CPU_MATMULS, raising=False)
    with devices.counting_cpu_matmuls(torch.device("cuda", 0)) as counter:
        assert counter is None                                   # not asked
    monkeypatch.setenv(devices.COUNT_CPU_MATMULS, "1")
    with devices.counting_cpu_matmuls(torch.device("cpu")) as counter:
        assert counter is None                                   # a CPU run computes on the CPU by design
    with fake_device.use_fake_gpu(cpu_matmul_flops=None) as dev, devices.counting_cpu_matmuls(dev) as counter:
        a @ b                                                    # aten.mm
        torch.addmm(torch.zeros(4), a, b)                        # aten.addmm: the added tensor first
        torch.bmm(a[None].expand(3, 8, 16), b[None].expand(3, 16, 4))   # aten.bmm, 3 products
        a.to(dev) @ b.to(dev)                                    # on the device: not counted
    one = 2 * 8 * 16 * 4
    assert counter.flops == 5 * one
    assert counter.largest[0] == 3 * one and counter.largest[1].startswith("aten.bmm.default [(3, 8, 16), (3, 16, 4)]")


def test_a_stage_states_what_it_computed_on_the_cpu_while_on_a_device(tmp_path, monkeypatch):
    """SFT on the fake accelerator with the counter asked for: its model work all on the device
    (0 GFLOP); with a forward of the CPU copy of its model planted where it saves the model, the
    count is that forward's."""
    from pipeline.config import Params, from_dict
    from pipeline.stages import skeleton, sft
    from pipeline.stages.prepare import write as prepare_run
    from pipeline.training import distributed

    params = from_dict(Params, TINY, "tiny: ")
    prepare_run(params.data, tmp_path / "data")
    monkeypatch.setenv(devices.COUNT_CPU_MATMULS, "1")
    planted: list[float] = []
    save = skeleton.save_checkpoint

    def save_after_a_cpu_forward(model, tok, out):
        cpu = model.to("cpu")   # what a final evaluation on the CPU copy of the model did
        with devices.counting_cpu_matmuls(torch.device(fake_device.NAME)) as alone:
            cpu(input_ids=torch.full((16, 64), tok.bos_token_id))   # the size of an evaluation batch
        planted.append(alone.flops)
        save(cpu, tok, out)

    with fake_device.use_fake_gpu() as dev:
        monkeypatch.setattr(distributed, "resolve_device", lambda cfg, local_rank=0: dev)
        sft.run(params, tmp_path / "data", tmp_path / "clean", progress=False)
        monkeypatch.setattr(skeleton, "save_checkpoint", save_after_a_cpu_forward)
        with pytest.raises(fake_device.CpuComputeError):   # the fake device's own rule stops it
            sft.run(params, tmp_path / "data", tmp_path / "rule", progress=False)
    with fake_device.use_fake_gpu(cpu_matmul_flops=None):   # that rule off: the stage's count states it
        sft.run(params, tmp_path / "data", tmp_path / "planted", progress=False)
    clean = json.loads((tmp_path / "clean" / "metrics.json").read_text())["resources"]
    assert clean["cpu_matmul_gflop"] == 0.0
    got = json.loads((tmp_path / "planted" / "metrics.json").read_text())["resources"]["cpu_matmul_gflop"]
    assert planted and got == pytest.approx(planted[-1] / 1e9) and got > 0
