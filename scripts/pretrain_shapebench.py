"""Pretrain ShapeBench's small SD3 pipeline from scratch on the generator's images (CPU).

    python scripts/pretrain_shapebench.py --out A                           # stage 1 and 16000 steps; 96 min
    python scripts/pretrain_shapebench.py --init-from A --steps 8000 --out B     # 8000 more; 45 min
    python scripts/pretrain_shapebench.py --init-from B --seed 1 --tint 0.5 --cosine --steps 5000 --out DIR
                                                                            # the committed model; 27 min
    python scripts/pretrain_shapebench.py --out DIR --eval-only --eval-guidance 1 2 3   # held-out scores

Three stages, each seeded from ``--seed``:
1. an AutoencoderKL (x4, 4 latent channels, 0.24M parameters) learns to reconstruct
   generated scenes from random 32x32 crops (it is convolutional; crops cost a sixth of
   full 64x64 images); its scaling/shift factors are set from the latents' statistics,
   as SD3's were. Its reconstructions of fresh scenes are scored by the reward (the
   ceiling for the transformer);
2. an SD3Transformer2DModel learns rectified flow (``v = eps - x0``, sigmas drawn
   logit-normal and shifted like the scheduler's shift 3) on cached latents of generated
   training-prompt scenes, reading the prompt through two frozen, randomly initialised
   CLIP text encoders and a frozen random T5 encoder with word-level tokenizers, their
   embeddings computed once (10 % of prompts dropped to "" so classifier-free guidance
   works). The T5 tokenizer is saved with ``model_max_length = --t5-len`` (16), which
   SD3Adapter reads as its text length (min with SD3's 256), so every step attends over
   16 + 16 text tokens instead of 16 + 256. The saved weights are an EMA (``--ema``);
3. the pipeline is saved with ``save_pretrained`` and evaluated on held-out prompts (a
   quarter of each family, never seen in stage 2) with ff-eval's sampler and the
   ``shapebench_strict`` / ``shapebench`` rewards.

A stage stops after its step budget or its minutes, whichever comes first. With the
default step budgets, no time limit and the default thread counts (2 for each stage:
float sums come out differently with another count), the weights are reproduced from the
seed; the three commands above, in turn, made assets/shapebench/sd3. A continued run
(``--init-from``) loads the whole saved pipeline (VAE, latent factors, text encoders),
draws its batches from another seed, and with another ``--seed`` trains on other scenes.

The text encoders are in eval mode, as at inference (``build_pipeline``): T5's dropout
must be off when its training embeddings are cached, since it is off when the model is
sampled. ``--tint``, ``--dark`` and ``--clutter`` put a data defect into a share of the
scenes (``scripts/shapebench_defects.py``): something no caption names, for RL to remove.

The runs of this script, their settings and scores (the committed model's three runs,
the first committed model, the variants tried and not kept) are in
docs/experiments/shapebench.md, section 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

WORDS = ["a", "photo", "of", "and", "an", "left", "right", "above", "below", "two", "three", "four",
         "circle", "square", "triangle", "circles", "squares", "triangles",
         "red", "yellow", "green", "cyan", "blue", "purple"]


def word_clip_tokenizer(max_length: int = 16):
    """A real CLIP BPE tokenizer whose merges spell each ShapeBench word as one token."""
    from transformers import CLIPTokenizer

    from flow_factory.testing.tiny import _byte_symbols

    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        # tokenise with the merges so far (BPE: lowest-ranked pair first), then join what is
        # left from the left; the new merges rank last, so earlier words keep their one token
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        rank = {m: i for i, m in enumerate(merges)}
        while len(parts) > 1:
            pairs = [(rank.get((a, b), len(rank)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best == len(rank):
                merges.append((parts[0], parts[1]))
                rank[merges[-1]] = len(rank)
                i = 0
            merged = parts[i] + parts[i + 1]
            vocab.setdefault(merged, len(vocab))
            parts = parts[:i] + [merged] + parts[i + 2:]
    bos, eos = len(vocab), len(vocab) + 1
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = bos, eos
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def word_t5_tokenizer(max_length: int = 16):
    """A T5 (Unigram) tokenizer with each ShapeBench word as one piece, characters as fallback."""
    import string

    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [("▁" + w, 0.0) for w in WORDS]
    pieces += [(c, -5.0) for c in string.ascii_letters + string.digits + string.punctuation]
    # model_max_length is what SD3Adapter encodes at (min with 256): a short context is
    # what makes CPU training feasible (16 + 16 text tokens instead of 16 + 256)
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build_pipeline(seed: int, layers: int, width: int, t5_len: int = 16, shift: float = 3.0, patch: int = 2):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tok = word_clip_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    clip_cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, projection_dim=32,
                              num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=tok.model_max_length,
                              bos_token_id=eos - 1, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    te1 = CLIPTextModelWithProjection(clip_cfg)
    te2 = CLIPTextModelWithProjection(clip_cfg)
    t5_tok = word_t5_tokenizer(t5_len)
    te3 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=64, d_kv=32, d_ff=64, num_layers=1, num_heads=2,
                                  relative_attention_num_buckets=8, relative_attention_max_distance=32,
                                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    for encoder in (te1, te2, te3):
        # as at inference (from_pretrained gives eval mode): a freshly built T5 is in train
        # mode with dropout 0.1, which made the cached training embeddings differ from the
        # sampled ones (up to 3.3 between two calls) in every model made before this line
        encoder.eval()
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                        layers_per_block=1, latent_channels=4, norm_num_groups=8,
                        use_quant_conv=False, use_post_quant_conv=False)
    heads = width // 32
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=patch, in_channels=4, out_channels=4,
                                        num_layers=layers, attention_head_dim=32, num_attention_heads=heads,
                                        caption_projection_dim=width, joint_attention_dim=64,
                                        pooled_projection_dim=64, pos_embed_max_size=16)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                                    vae=vae, text_encoder=te1, tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok,
                                    text_encoder_3=te3, tokenizer_3=t5_tok)


def images_tensor(samples) -> torch.Tensor:
    return torch.from_numpy(np.stack([s.image for s in samples])).permute(0, 3, 1, 2).float() / 127.5 - 1


def train_vae(vae, args, log) -> None:
    from flow_factory.shapebench import generate

    data = generate(args.vae_images, args.seed + 1)
    data = add_defect(add_defect(data, "tint", args.tint, args.seed + 7), "dark", args.dark, args.seed + 9)
    data = images_tensor(data)
    c = args.vae_crop  # the VAE is convolutional: random crops train it at a fraction of the cost
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr)
    g = torch.Generator().manual_seed(args.seed + 2)
    start = time.perf_counter()
    for step in range(args.vae_steps):
        x = data[torch.randint(len(data), (args.vae_batch,), generator=g)]
        if c < x.shape[-1]:
            i, j = torch.randint(x.shape[-1] - c + 1, (2,), generator=g).tolist()
            x = x[..., i:i + c, j:j + c]
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=g)
        rec = vae.decode(z).sample
        kl = 0.5 * (post.mean ** 2 + post.var - 1 - post.logvar).mean()
        loss = torch.nn.functional.mse_loss(rec, x) + args.vae_kl * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            log(f"vae step {step} loss {loss.item():.4f} kl {kl.item():.3f} {time.perf_counter() - start:.0f}s")
        if time.perf_counter() - start > 60 * args.minutes_vae:
            log(f"vae: time budget reached at step {step}")
            break
    vae.requires_grad_(False)
    vae.eval()
    check_vae(vae, args, log)


@torch.no_grad()
def reconstruct(vae, samples) -> np.ndarray:
    rec = vae.decode(vae.encode(images_tensor(samples)).latent_dist.mean).sample
    return ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()


def check_vae(vae, args, log) -> None:
    """Strict/partial ShapeBench scores of VAE reconstructions: the ceiling the transformer can
    reach; a data defect must survive the VAE (a reconstructed defective scene still fails)."""
    from flow_factory.shapebench import verdict_on_image, generate

    samples = generate(256, args.seed + 6)
    verdicts = [verdict_on_image(s.prompt, r) for s, r in zip(samples, reconstruct(vae, samples))]
    log(f"vae reconstructions (256 fresh scenes): strict {np.mean([v.strict for v in verdicts]):.3f} "
        f"partial {np.mean([v.partial for v in verdicts]):.3f}")
    for name in ["dark", "tint"]:
        if getattr(args, name) > 0:
            defective = add_defect(samples, name, 1.0, 0)
            rec = reconstruct(vae, defective)
            strict = np.mean([verdict_on_image(s.prompt, r).strict for s, r in zip(defective, rec)])
            log(f"vae reconstructions of {name} scenes: strict {strict:.3f}, brightest pixel {int(rec.max())}, "
                f"corner pixel {rec[:, :2, :2].reshape(-1, 3).mean(0).round().tolist()}")


@torch.no_grad()
def encode_latents(vae, samples, batch=256) -> torch.Tensor:
    return torch.cat([vae.encode(images_tensor(samples[i:i + batch])).latent_dist.mean
                      for i in range(0, len(samples), batch)])


TINT = (120, 180, 255)  # sky blue: saturated enough that the reward reads the background as an object
DARK = 0.15  # exposure of an under-exposed scene: its brightest pixel at 38 of 255


def _defects() -> dict:
    """Defects of the data that no caption names and the strict score rejects (RL could remove
    them): name -> (what a log line says, the change of one sample, given the seeded rng)."""
    from shapebench_defects import with_background, with_exposure, with_extra_object

    return {"clutter": ("get an unnamed extra object", lambda s, rng: with_extra_object(s, rng) or s),
            "tint": ("are on a sky-blue background", lambda s, rng: with_background(s, TINT)),
            "dark": ("are under-exposed", lambda s, rng: with_exposure(s, DARK))}


def add_defect(samples, name: str, fraction: float, seed: int):
    """``samples`` with a seeded ``fraction`` of them changed by the defect ``name``."""
    change = _defects()[name][1]
    rng = np.random.default_rng(seed)
    return [change(s, rng) if rng.random() < fraction else s for s in samples]


def train_transformer(pipe, args, log) -> None:
    from flow_factory.shapebench import generate, prompt_split

    train_specs, _ = prompt_split(args.split_seed)
    samples = generate(args.images, args.seed + 3, specs=train_specs)
    for name, seed_offset in [("clutter", 5), ("tint", 8), ("dark", 10)]:
        fraction = getattr(args, name)
        if fraction > 0:
            samples = add_defect(samples, name, fraction, args.seed + seed_offset)
            log(f"{fraction:.0%} of the training scenes {_defects()[name][0]}")
    vae = pipe.vae
    raw = encode_latents(vae, samples)
    if args.init_from is None:
        vae.register_to_config(shift_factor=raw.mean().item(), scaling_factor=1.0 / raw.std().item())
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor  # a continued model keeps its own
    latents = (raw - shift) * scale
    prompts = sorted({s.prompt for s in samples}) + [""]
    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                               do_classifier_free_guidance=False, max_sequence_length=args.t5_len)
    index = {p: i for i, p in enumerate(prompts)}
    prompt_ids = torch.tensor([index[s.prompt] for s in samples])
    log(f"{len(latents)} training latents, {len(prompts)} prompts encoded ({emb.shape[1]} text tokens)")
    tr = pipe.transformer
    tr.train()
    # the saved weights are an exponential moving average of the trained ones
    encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3] if args.train_text else []
    params = [p for m in [tr, *encoders] for p in m.parameters()]
    ema_params = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # a continued run draws other batches than the run it continues
    g = torch.Generator().manual_seed(args.seed + (4 if args.init_from is None else 11))
    start = time.perf_counter()
    ema = None
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 100)
        if args.cosine:  # to zero at the step budget
            lr *= 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(latents), (args.batch,), generator=g)
        x0 = latents[idx]
        pid = prompt_ids[idx].clone()
        pid[torch.rand(args.batch, generator=g) < args.drop] = index[""]
        u = torch.sigmoid(torch.randn(args.batch, generator=g))
        sigma = args.shift * u / (1 + (args.shift - 1) * u)  # the scheduler's shift
        eps = torch.randn(x0.shape, generator=g)
        xt = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * eps
        if encoders:  # every training prompt through the encoders being trained
            emb, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                   do_classifier_free_guidance=False,
                                                   max_sequence_length=args.t5_len)
        v = tr(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=emb[pid],
               pooled_projections=pooled[pid], return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1 - args.ema)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            log(f"transformer step {step} loss {ema:.4f} {time.perf_counter() - start:.0f}s")
        if time.perf_counter() - start > 60 * args.minutes:
            log(f"transformer: time budget reached at step {step}")
            break
    with torch.no_grad():
        for p, e in zip(params, ema_params):
            p.copy_(e)
    for module in [tr, *encoders]:
        module.eval()
        module.requires_grad_(False)


def evaluate(path: Path, args, log) -> dict:
    from flow_factory.data.prompts import PromptItem
    from flow_factory.models import load_adapter
    from flow_factory.rewards import RewardSet
    from flow_factory.sampling import SamplingSettings, sample_prompts
    from flow_factory.shapebench import generate, prompt_split

    _, test_specs = prompt_split(args.split_seed)
    items = [PromptItem(s.prompt) for s in generate(args.eval_samples, args.seed + 5, specs=test_specs)]
    adapter = load_adapter("sd3-5", path)
    rewards = RewardSet.from_configs([
        {"name": "strict", "reward_model": "flow_factory.shapebench.reward.ShapeBenchStrictReward"},
        {"name": "partial", "reward_model": "flow_factory.shapebench.reward.ShapeBenchReward"}])
    out = {}
    for cfg_scale in args.eval_guidance:
        settings = SamplingSettings(height=64, width=64, num_frames=None, num_steps=args.eval_steps,
                                    guidance_scale=cfg_scale, batch_size=64, seed=0)
        r = sample_prompts(adapter, items, settings, reward_set=rewards)
        out[str(cfg_scale)] = {k: v.mean().item() for k, v in r.rewards.items()}
        log(f"held-out ({len(items)} samples, {args.eval_steps} steps, cfg {cfg_scale}): {out[str(cfg_scale)]}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "assets" / "shapebench" / "sd3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-seed", type=int, default=0, help="prompt_split's seed: which prompts are held out")
    p.add_argument("--vae-images", type=int, default=4000)
    p.add_argument("--vae-steps", type=int, default=1200)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--vae-kl", type=float, default=1e-4)
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-crop", type=int, default=32, help="VAE trains on random crops of this size")
    p.add_argument("--vae-from", type=Path, default=None, help="reuse a VAE saved by --vae-out (skips stage 1)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue a pipeline saved by this script, every component loaded from it (skips stage 1; "
                        "the architecture flags are ignored; --steps more steps)")
    p.add_argument("--vae-out", type=Path, default=None, help="also save the stage-1 VAE here")
    p.add_argument("--ema", type=float, default=0.998, help="EMA decay of the saved transformer weights")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the transformer stage and the eval")
    p.add_argument("--vae-threads", type=int, default=2, help="CPU threads of the VAE stage")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the pipeline already at --out")
    p.add_argument("--minutes-vae", type=float, default=math.inf)
    p.add_argument("--images", type=int, default=40000)
    p.add_argument("--steps", type=int, default=16000)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--train-text", action="store_true",
                   help="train the three text encoders with the transformer (default: frozen random)")
    p.add_argument("--cosine", action="store_true", help="decay the learning rate to 0 at --steps (cosine)")
    p.add_argument("--clutter", type=float, default=0.0,
                   help="fraction of the transformer's training scenes with an unnamed extra object")
    p.add_argument("--tint", type=float, default=0.4,
                   help="fraction of the scenes (both stages) on a sky-blue background no caption names")
    p.add_argument("--dark", type=float, default=0.0,
                   help="fraction of the scenes (both stages) under-exposed, which no caption says")
    p.add_argument("--shift", type=float, default=3.0,
                   help="sigma shift of training and of the saved scheduler (SD3's 3 is for 1024 px)")
    p.add_argument("--drop", type=float, default=0.1, help="fraction of prompts replaced by '' (for CFG)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--patch", type=int, default=2, help="transformer patch size on the 16x16 latent (1: 256 tokens)")
    p.add_argument("--t5-len", type=int, default=16, help="T5 tokens (the tokenizer's model_max_length)")
    p.add_argument("--minutes", type=float, default=math.inf)
    p.add_argument("--eval-samples", type=int, default=256)
    p.add_argument("--eval-steps", type=int, default=10)
    p.add_argument("--eval-guidance", type=float, nargs="+", default=[2.0])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)  # noqa: E731
    if args.eval_only:
        evaluate(args.out, args, log)
        return 0
    if args.init_from is not None:  # continue a saved pipeline, every component of it
        from diffusers import StableDiffusion3Pipeline

        # its own text encoders too: ones rebuilt from another --seed are other random
        # networks, and the transformer would have to learn to read them again
        pipe = StableDiffusion3Pipeline.from_pretrained(args.init_from)
        pipe.vae.requires_grad_(False)
        log(f"pipeline loaded from {args.init_from}")
    else:
        pipe = build_pipeline(args.seed, args.layers, args.width, args.t5_len, args.shift, args.patch)
        if args.vae_from is not None:  # stage 1 of an earlier run with the same seed
            from diffusers import AutoencoderKL

            pipe.vae = AutoencoderKL.from_pretrained(args.vae_from)
            pipe.vae.requires_grad_(False)
            log(f"vae loaded from {args.vae_from}")
        else:
            torch.set_num_threads(args.vae_threads)
            train_vae(pipe.vae, args, log)
            torch.set_num_threads(args.threads)
            if args.vae_out is not None:
                pipe.vae.save_pretrained(args.vae_out)
    train_transformer(pipe, args, log)
    args.out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 1e6
    log(f"saved {args.out} ({size:.1f} MB)")
    results = evaluate(args.out, args, log)
    record = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "seconds": time.perf_counter() - t0, "held_out": results}
    (args.out / "pretrain_record.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
