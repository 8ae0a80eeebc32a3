"""``train.optimizer``: AdamW, or Muon for the weight matrices with AdamW for the rest, as one optimizer
that equals the two run apart, checkpoints and resumes exactly (in ``ff-train`` too), and is refused
where a backend would hand it shards of the matrices."""

import io
import json

import pytest
import torch
from helpers_runs import straight_and_resumed, tiny_run_config
from safetensors.torch import load_file
from test_config import minimal

from flow_factory.config import ConfigError, parse_config
from flow_factory.trainer.optimizers import MuonWithAdamW
from flow_factory.trainer.backends import check_optimizer_backend

SETTINGS = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((6, 4), (4,), (3, 6), (1,))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_muon_with_adamw_is_torchs_muon_on_the_matrices_and_adamw_on_the_rest():
    ours, apart = _params(), _params()
    hybrid = MuonWithAdamW(ours, **SETTINGS)
    muon = torch.optim.Muon([apart[0], apart[2]], lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([apart[1], apart[3]], **SETTINGS)
    for step in range(3):
        _grads(ours, step)
        _grads(apart, step)
        hybrid.step()
        muon.step()
        adamw.step()
    for a, b in zip(ours, apart):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(hybrid.param_groups) == 2 and set(hybrid.state) == set(ours)


def test_its_state_saves_and_resumes_exactly():
    params = _params()
    first = MuonWithAdamW(params, **SETTINGS)
    for step in range(2):
        _grads(params, step)
        first.step()
    saved = io.BytesIO()  # as a checkpoint holds it: the loaded state shares no tensor with the first's
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    copy = [torch.nn.Parameter(p.detach().clone()) for p in params]
    second = MuonWithAdamW(copy, **SETTINGS)
    second.load_state_dict(torch.load(saved, weights_only=True))
    second.param_groups[0]["lr"] = 0.02  # a group's lr set on the outer optimizer reaches the inner one
    assert second.muon.param_groups[0] is second.param_groups[0] and second.muon.state is second.state
    for step in range(2, 4):
        for ps in (params, copy):
            _grads(ps, step)
        first.step()
        second.step()
    for a, b in zip(params, copy):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_config_reads_it_from_flow_factorys_optimizers_list_and_refuses_sharded_backends():
    cfg = parse_config({**minimal(), "optimizers": [{"name": "default", "optimizer": "muon", "learning_rate": 3e-4}]})
    assert (cfg.train.optimizer, cfg.train.learning_rate, cfg.train.muon_adjust_lr) == ("muon", 3e-4, "match_rms_adamw")
    check_optimizer_backend(cfg, "ddp")
    sharded = cfg.model_copy(update={"config_file": "fsdp2"})
    with pytest.raises(ConfigError, match=r"train.optimizer: muon updates each weight matrix whole, but config_file: "
                                          r"fsdp2 shards them \(fsdp\); use adamw, or multi_gpu \(DDP\)"):
        check_optimizer_backend(sharded, "fsdp")
    with pytest.raises(ConfigError, match=r"train.optimizer: expected one of 'adamw', 'muon', got 'lion'"):
        parse_config(minimal(train={"optimizer": "lion"}))


def test_ff_train_with_muon_resumes_exactly(tmp_path, tiny_sd3_path):
    """A LoRA's weights are all matrices: every one trained by Muon, its momentum in the checkpoint; stopped
    after epoch 1 and resumed, the run ends at the uninterrupted run's LoRA."""
    straight, resumed = (run / "checkpoints" for run in straight_and_resumed(
        tmp_path, lambda folder, epochs: tiny_run_config(folder, "sd3-5", tiny_sd3_path, max_epochs=epochs,
                                                         optimizer="muon", gradient_step_per_epoch=2, group_size=4),
        epochs=3, stop_after=1))
    state = torch.load(straight / "epoch_3" / "optimizer.pt", weights_only=True)
    assert state["state"] and all("momentum_buffer" in s for s in state["state"].values())
    assert json.loads((straight / "epoch_3" / "trainer_state.json").read_text())["epoch"] == 3
    a, b = (load_file(d / "epoch_3" / "pytorch_lora_weights.safetensors") for d in (straight, resumed))
    assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
