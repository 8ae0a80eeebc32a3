"""bench/gradient_snr.py measures what it says: batches differ only by their noise, and the
gradient is the algorithm's loss gradient over every trained parameter."""

import gradient_snr as bench
import torch
from helpers_runs import tiny_run_config, write_config


def test_same_seed_same_gradient_other_seed_other_noise(tmp_path, tiny_sd3_path):
    from flow_factory.config import load_config
    from flow_factory.trainer import Trainer

    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, group_size=4, per_device_batch_size=4)
    path = write_config(tmp_path, config)
    trainer = Trainer(load_config(path, ["log.logging_backend=none"]))
    before = [p.detach().clone() for p in trainer.params]
    a, reward_a = bench.batch_gradient(trainer, 1000)
    again, _ = bench.batch_gradient(trainer, 1000)
    b, _ = bench.batch_gradient(trainer, 1001)
    assert a.numel() == sum(p.numel() for p in trainer.params)  # every trained (LoRA) parameter
    assert a.norm() > 0 and torch.isfinite(torch.tensor(reward_a))
    assert torch.allclose(a, again, atol=1e-7, rtol=1e-5)
    assert not torch.allclose(a, b)
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, before))  # no optimizer step

    row = bench.measure(path, "grpo-fast", "jpeg_compressibility", 3, ["log.logging_backend=none"])
    assert row["n"] == 8 and -1 <= row["cos"] <= 1 and row["se"] >= 0
