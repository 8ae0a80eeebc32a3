"""The ``train`` section: sampling geometry, batch arithmetic inputs, algorithm, EMA and optimiser settings.

Checks that need other sections (dynamics, number of processes, model type) live in
``schema.Config``; this file checks only what ``train`` alone can know.
"""

from __future__ import annotations

from typing import Literal

from pydantic import NonNegativeInt, PositiveInt, field_validator, model_validator

from .algorithms import ALGORITHM_SPECS, TRAINER_TYPES
from .distillation import DISTILLATION_SPECS
from .base import DTYPE_NAMES, Section, as_list, canonical_choice, check_resolution, problem, resolution_pair, setting, show

TIME_SAMPLING_STRATEGIES = ("uniform", "logit_normal", "discrete", "discrete_with_init", "discrete_wo_init")


def range_fractions(timestep_range: float | list[float]) -> tuple[float, float]:
    """``timestep_range`` as (lo, hi) fractions of the denoising axis: ``f`` -> (0, f)."""
    if isinstance(timestep_range, (int, float)):
        return 0.0, float(timestep_range)
    lo, hi = timestep_range
    return float(lo), float(hi)


def resolve_num_train_timesteps(train) -> int:
    """``num_train_timesteps``, or when null ``max(1, int(num_inference_steps * (hi - lo)))``: as many
    as the sampler has steps in the range (Flow-Factory's default). Works on any object with the keys."""
    if train.num_train_timesteps is not None:
        return train.num_train_timesteps
    lo, hi = range_fractions(train.timestep_range)
    return max(1, int(train.num_inference_steps * (hi - lo) + 1e-9))


def fill_trainer_defaults(train) -> None:
    """The defaults of ``train.trainer_type``'s ``AlgorithmSpec`` for the keys the config does not give."""
    spec = ALGORITHM_SPECS[train.trainer_type]
    if train.time_shift is None:
        train.time_shift = spec.time_shift
    if spec.family != "coupled" and "kl_type" not in train.model_fields_set:
        # their KL (when any) is on velocities: so a resolved config (to_yaml, what ff-sample and ff-eval read
        # back) says so, and is not refused for the coupled family's x-based default
        train.kl_type = "v-based"
    for key, value in spec.defaults.items():
        if key not in train.model_fields_set:
            setattr(train, key, value)


def trainer_problems(train) -> list[str]:
    """Keys of another algorithm given other values than their defaults (a resolved config writes
    every default), and what crd cannot do in this version."""
    out, named = [], set(ALGORITHM_SPECS[train.trainer_type].keys)
    for owner, keys in ((n, a.keys) for n, a in ALGORITHM_SPECS.items() if a.keys):
        if owner == train.trainer_type:
            continue
        given = [k for k in keys if k not in named
                 and getattr(train, k) != TrainConfig.model_fields[k].get_default(call_default_factory=True)]
        named.update(keys)
        if given:
            out.append(f"train: {', '.join(given)} are {owner}'s; {train.trainer_type} does not use them")
    own_sampler = ALGORITHM_SPECS[train.trainer_type].own_sampler
    if own_sampler and train.off_policy:
        out.append(f"train.off_policy: {train.trainer_type} samples with {own_sampler}, not the EMA; use false")
    return out


# crd's decay schedules (Flow-Factory's trainers/crd.py); parsed here so the config checks them without
# torch. Named presets: (start_step, start_value, slope, end_value)
DECAY_PRESETS = {
    "0": (0, 0.0, 0.0, 0.0), "1": (0, 0.0, 0.001, 0.5), "2": (75, 0.0, 0.0075, 0.999), "3": (0, 1.0, 0.0, 1.0),
    "4": (0, 0.0, 0.02, 0.99), "5": (0, 0.0, 0.01, 0.5), "6": (0, 0.0, 0.0075, 0.999),
    "none": (0, 0.0, 0.0, 0.0), "slow": (0, 0.0, 0.001, 0.5), "medium": (75, 0.0, 0.0075, 0.999),
    "offline": (0, 1.0, 0.0, 1.0), "fast": (0, 0.0, 0.02, 0.99), "moderate": (0, 0.0, 0.01, 0.5),
}


def parse_decay(schedule: str | int) -> tuple[int, float, float, float]:
    """A preset name / number or ``"start_step-start_value-slope-end_value"``."""
    key = str(schedule).strip()
    if key in DECAY_PRESETS:
        return DECAY_PRESETS[key]
    parts = key.split("-")
    try:
        if len(parts) != 4:
            raise ValueError
        start, v0, slope, end = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{schedule!r}: a decay is 'start_step-start_value-slope-end_value' (e.g. "
                         f"'0-0.25-0.005-0.999') or one of {list(DECAY_PRESETS)}") from None
    if start < 0 or start != int(start) or not (0 <= v0 <= 1 and 0 <= end <= 1) or slope < 0:
        raise ValueError(f"{schedule!r}: start_step must be a whole number >= 0, the values in [0, 1], slope >= 0")
    return int(start), v0, slope, end


class TeacherEntry(Section):
    """One teacher of ``trainer_type: diffusion-opd`` (``train.teachers``): a LoRA of the base model, frozen, serving
    the datasets it names."""

    name: str | None = setting(None, "its name, in its metrics (distill_loss_<name>); null = opd_teacher_<i>",
                               min_length=1)
    path: str = setting(description="its LoRA: a folder holding pytorch_lora_weights.safetensors (what ff-train's "
                        "checkpoints and pipe.save_lora_weights write), that file itself, or a hub repo id "
                        "owner/name[/subfolder]", min_length=1)
    applicable_datasets: list[str] = setting(
        default_factory=list, description="the datasets (data.datasets' names) whose samples it scores; one "
        "teacher per dataset; a run of one dataset (data.dataset_dir) with one teacher leaves it out")
    guidance_scale: float | None = setting(
        None, "the CFG scale it is queried at; null = the student's guidance_scale", ge=0)


class TrainConfig(Section):
    trainer_type: Literal[TRAINER_TYPES] = setting(
        "grpo", "algorithm: grpo, grpo-guard, dppo (coupled, SDE rollouts), nft, awm, dpo, dgpo, crd (decoupled, "
        "any dynamics), sft, offline-dpo (from a dataset's images or videos: schema_version 2 records, no rewards), dmd2 "
        "and tdm (a few-step generator distilled from the frozen model, with an online fake score; ODE rollouts), "
        "tdm-r1 (tdm with rewards, through a learned surrogate), or diffusion-opd (on-policy distillation of "
        "LoRA teachers, each serving its datasets)")
    resolution: int | list[int] = setting(512, "image size, an int or [height, width]",
                                          expects="an integer or [height, width]")
    num_frames: PositiveInt | None = setting(None, "frames per video (video models only; Wan needs 4k + 1); "
                                             "null = 81 for video models")
    num_inference_steps: PositiveInt = setting(10, "denoising steps per rollout")
    guidance_scale: float = setting(4.5, "CFG scale (or FLUX's embedded guidance) during rollouts", ge=0)
    train_guidance_scale: float | None = setting(
        None, "decoupled algorithms (nft, awm, dpo, dgpo, crd): CFG scale of the velocity the loss trains (both "
        "experts of a two-expert model), e.g. 1.0 for Diffusion-DPO on the unguided velocity while rollouts use "
        "guidance_scale; null = guidance_scale. The coupled ones recompute the rollout's own steps", ge=0)
    guidance_scale_2: float | None = setting(
        None, "CFG scale of a two-expert model's low-noise expert (Wan2.2 A14B's transformer_2); null = "
        "guidance_scale, as the pipeline", ge=0)
    strength: float | None = setting(
        None, "video-to-video (wan2_v2v): the part of the schedule that regenerates the condition video, in (0, 1] "
        "(the last int(num_inference_steps x strength) steps); null = 0.8, the pipeline's default", gt=0, le=1)
    condition_image_size: int | list[int] | None = setting(
        None, "size condition images are resized to, an int or [height, width] (conditioned models: flux1-kontext, "
        "wan2_i2v; qwen-image-edit-plus: the area each image is resized to at its own aspect ratio); null = the "
        "size generated (qwen-image-edit-plus: its pipeline's 1024x1024)", expects="an integer, [height, width] or null")
    auto_resize: bool | None = setting(
        None, "generate at the aspect ratio of the condition images, at the area of resolution (conditioned models; "
        "a split's condition images must then share one aspect ratio); null = the model's default (flux1-kontext, "
        "wan2_i2v: false; qwen-image-edit-plus: true)")

    frame_rate: float | None = setting(
        None, "Flow-Factory compatibility, its videos' frame rate: LTX-2 takes only 24 (the pipeline's, which sets "
        "its audio's length and its frames' time positions); sft and offline-dpo of another video model read each "
        "record's video at this rate from its source fps (null: consecutive frames); elsewhere other models write "
        "videos at their own rate (Wan: 16), so there it changes nothing", gt=0)
    per_device_batch_size: PositiveInt = setting(8, "samples per process in one sampling / training micro-batch")
    group_size: PositiveInt = setting(16, "samples per prompt; advantages are normalised within a group")
    unique_sample_num_per_epoch: PositiveInt = setting(48, "distinct prompts per epoch (all processes together)")
    gradient_step_per_epoch: PositiveInt = setting(
        1, "optimizer steps per epoch; ignored when gradient_accumulation_steps is an integer")
    gradient_accumulation_steps: Literal["auto"] | PositiveInt = setting(
        "auto", "micro-steps per optimizer step; auto = derived from gradient_step_per_epoch",
        expects="'auto' or a positive integer")
    num_inner_epochs: PositiveInt = setting(1, "passes over each epoch's rollouts")
    max_epochs: PositiveInt = setting(100, "number of epochs (sample + optimise rounds) to run")
    same_latent: bool = setting(False, "the samples of a group start from the same noise")

    optimizer: Literal["adamw", "muon"] = setting(
        "adamw", "adamw, or muon: Muon (Newton-Schulz orthogonalised momentum) for the weight matrices, AdamW "
        "for the other weights (DDP or one process; not under fsdp2 or DeepSpeed, which shard the matrices)")
    learning_rate: float | None = setting(None, "learning rate; null = 1e-4 for LoRA, 1e-5 for full", gt=0)
    adam_beta1: float = setting(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = setting(0.999, "AdamW beta2", ge=0, lt=1)
    adam_betas: list[float] | None = setting(
        None, "Flow-Factory spelling of [adam_beta1, adam_beta2]; read into them", exclude=True,
        expects="[beta1, beta2]")
    adam_weight_decay: float = setting(1e-4, "AdamW decoupled weight decay", ge=0)
    adam_epsilon: float = setting(1e-8, "AdamW epsilon", gt=0)
    muon_momentum: float = setting(0.95, "muon: momentum", ge=0, lt=1)
    muon_nesterov: bool = setting(True, "muon: Nesterov momentum")
    muon_ns_steps: PositiveInt = setting(5, "muon: Newton-Schulz iterations per update")
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = setting(
        "match_rms_adamw", "muon: scale each update to AdamW's RMS (match_rms_adamw: an AdamW learning_rate carries "
        "over) or by sqrt(max(1, rows / columns)) (original, Keller Jordan's)")
    max_grad_norm: float = setting(1.0, "clip the gradient's global norm to this", gt=0)
    role_optimizers: list[dict] = setting(
        default_factory=list, description="dmd2, tdm: one optimizer per trainable role (generator, fake), "
        "Flow-Factory's top-level optimizers: list read here: [{name: <role>, optimizer, learning_rate, betas, weight_decay, eps, "
        "max_grad_norm, muon_*, ema_decay}]; a role without an entry takes Flow-Factory's default for it (learning_rate, "
        "betas) and this section's other optimizer keys; ema_decay (ours; not the generator's, whose EMA is "
        "ema_decay here) keeps an EMA of that role, moved as the generator's (ema_decay_schedule, "
        "ema_update_interval, ema_device) and saved as <role>_ema.pt")
    ttur_fake_updates: PositiveInt = setting(
        5, "dmd2, tdm: fake-score optimizer steps before each generator step (the two time-scale update rule)")
    perturbation_timestep_range: list[float] = setting(
        default_factory=lambda: [0.02, 0.98], description="dmd2: the noise levels (sigma, drawn "
        "uniformly in [lower, upper] within [0, 1], one per sample) at which the generator's clean predictions are "
        "noised again, for the fake score's loss and both scores' queries; tdm accepts the key but draws its "
        "queries inside each stage of its schedule", expects="[lower, upper]")
    real_guidance_scale: float | None = setting(
        None, "dmd2, tdm: the CFG scale of the frozen teacher's score; null = guidance_scale", ge=1)
    replay_rtol: float = setting(1e-4, "dmd2, tdm, tdm-r1: the rollout replay's relative tolerance: the generator's "
                                 "step recomputed from a rollout state with its live velocity must land within "
                                 "replay_atol + replay_rtol |x_next| (and half a spacing of latent_storage_dtype) "
                                 "of the state the rollout stored, else the run stops", ge=0)
    replay_atol: float = setting(1e-4, "dmd2, tdm, tdm-r1: the rollout replay's absolute tolerance (replay_rtol)",
                                 ge=0)
    use_huber: bool = setting(True, "tdm: the generator's revised-x0 loss is pseudo-Huber (else squared)")
    huber_c: float = setting(1e-3, "tdm: the pseudo-Huber loss's c, sqrt(d^2 + c^2) - c", gt=0)
    tdm_snr_gamma: float = setting(5.0, "tdm: the fake score's loss weight min(SNR, gamma)", gt=0)
    tdm_importance_clip: float = setting(
        20.0, "tdm: the fake score's importance ratio (the re-noising's mixed noise against a fresh Gaussian) is "
        "clipped to [1/c, c]", gt=0)
    tdm_query_interval: Literal["trajectory", "reverse"] = setting(
        "trajectory", "tdm: where a transition's scores are queried: inside its stage (sigma_{k+1}, sigma_k), or "
        "reverse: (sigma_{k+1}, tdm_query_max_sigma)")
    tdm_query_distribution: Literal["actual_uniform", "conditional_logit_normal", "source_uniform"] = setting(
        "actual_uniform", "tdm: how the query level is drawn in its interval: uniform in sigma, a logit-normal "
        "truncated to it, or source_uniform: uniform in the unshifted schedule of the model's static flow shift "
        "(a resolution-dependent shift needs scheduler.flow_shift)")
    tdm_query_max_sigma: float = setting(1.0, "tdm: the upper end of the reverse query interval", gt=0, le=1)
    tdm_query_logit_mean: float = setting(0.0, "tdm: conditional_logit_normal's mean")
    tdm_query_logit_std: float = setting(1.0, "tdm: conditional_logit_normal's standard deviation", gt=0)
    tdm_weight: float = setting(
        0.3, "tdm-r1: the generator's reward mix, tdm_weight x the guidance reward + (1 - tdm_weight) x the "
        "surrogate's learned reward, beside the TDM term", gt=0, lt=1)
    cfg_reward_scale: float = setting(
        3.5, "tdm-r1: the guidance reward's scale (the teacher's guided minus conditional clean prediction); 0 = "
        "none", ge=0)
    surrogate_preference_beta: float = setting(1.0, "tdm-r1: the surrogate's group-preference beta", gt=0)
    surrogate_reference_beta: float = setting(
        1e-3, "tdm-r1: the surrogate's penalty on its denoising error's distance from the teacher's", ge=0)
    surrogate_reference_threshold: float = setting(
        0.05, "tdm-r1: a sample whose surrogate error moved past the teacher's by more than this (squared) the way "
        "its advantage asks gets no preference gradient", gt=0)
    surrogate_clip_range: float = setting(
        1e-3, "tdm-r1: the surrogate's trust region against its slow copy (a ratio exp(e_slow - e) outside "
        "1 +- this stops the gradient); 0 = none", ge=0)
    surrogate_slow_decay_min: float = setting(
        1e-3, "tdm-r1: the slow surrogate copy's decay after surrogate step k is min(max, min + 0.001 k)", ge=0, le=1)
    surrogate_slow_decay_max: float = setting(0.3, "tdm-r1: the slow surrogate copy's largest decay", ge=0, le=1)
    use_time_weighting: bool = setting(
        True, "tdm-r1: the surrogate's loss at transition k weighs (k + 2) / num_inference_steps")
    teachers: list[TeacherEntry] = setting(
        default_factory=list, description="diffusion-opd: the teachers distilled into the student along its own "
        "rollouts, each a LoRA of the base model routed to its datasets: [{name, path, applicable_datasets, "
        "guidance_scale}]")
    loss_target: Literal["xt", "v", "x0"] = setting(
        "xt", "diffusion-opd: where student and teacher are compared at each distilled step: xt = the step's mean "
        "(under an SDE divided by its variance), v = the velocity, x0 = the clean state it points at (v and x0: "
        "ODE rollouts)")
    self_normalize: bool = setting(
        False, "diffusion-opd: divide each sample's squared error by its mean absolute error (held constant)")
    max_nonfinite_in_a_row: NonNegativeInt = setting(
        3, "a NaN / inf reward, advantage or gradient norm skips its update; this many skips in a row "
        "stop the run (0 = stop at the first)")

    clip_range: float = setting(1e-4, "PPO clip range of the likelihood ratio", gt=0)
    adv_clip_range: float = setting(5.0, "advantages are clipped to [-adv_clip_range, adv_clip_range]", gt=0)
    kl_type: Literal["x-based", "v-based"] = setting(
        "x-based", "KL to the reference on step means (x-based) or on velocities (v-based)")
    kl_beta: float = setting(0.0, "KL coefficient; 0 = no KL and no reference model (crd: 0.1 when omitted)", ge=0)
    outside_kl_beta: float = setting(
        0.0, "grpo family: coefficient of the v-based KL to the reference at one step the SDE window does not "
        "train, drawn per sample (those steps share the trained weights); 0 = none", ge=0)
    ref_param_device: Literal["cpu", "cuda", "same"] = setting(
        "same", "where the frozen reference weights live (full fine-tuning with kl_beta or outside_kl_beta > 0): "
        "cpu, cuda, or same (as the model; also spelled same_as_model)")
    kl_mask_type: Literal["x-based", "v-based"] = setting(
        "x-based", "dppo: the trust region's KL(current || rollout) of a step, on its means (x-based) or velocities "
        "(v-based)")
    kl_mask_threshold: float = setting(
        1e-6, "dppo: a sample whose step KL(current || rollout) reaches this, and whose update pushes further away, "
        "gets no gradient", ge=0)
    kl_guidance_scale: float | None = setting(
        None, "dppo: CFG scale of the reference in the kl_beta penalty; null = guidance_scale", ge=0)
    global_std: bool = setting(True, "normalise advantages by the std of the whole batch, not each group's")
    advantage_aggregation: Literal["sum", "gdpo"] = setting(
        "gdpo", "several rewards: advantage of the weighted sum (sum) or weighted per-reward advantages (gdpo)")

    # decoupled algorithms (nft, awm, dpo, dgpo, crd)
    nft_beta: float = setting(1.0, "nft: strength of the implicit positive / negative policies", gt=0)
    nft_weighting: Literal["adaptive", "uniform"] = setting(
        "adaptive", "nft: flow error in x0 space normalised per sample (adaptive) or plain velocity MSE (uniform)")
    awm_weighting: Literal["Uniform", "t", "t**2", "huber", "ghuber"] = setting(
        "Uniform", "awm: weighting of the matching log-likelihood: Uniform, t, t**2, huber or ghuber")
    ghuber_power: float = setting(0.25, "awm: power p of the ghuber weighting", gt=0)
    kl_weight: str | int | float | None = setting(
        None, "Flow-Factory compatibility: set by its AWM examples, read by none of its trainers; does nothing "
        "(the KL terms are weighted by kl_beta and ema_kl_beta)")
    ema_kl_beta: float = setting(0.0, "awm: coefficient of the v-based KL to the EMA policy (needs ema_decay > 0)",
                                 ge=0)
    beta: float = setting(2000.0, "dpo: DPO temperature on the per-dimension flow-matching errors", gt=0)
    dpo_beta: float = setting(100.0, "dgpo: temperature of the group preference on the flow-matching errors", gt=0)
    use_shared_noise: bool = setting(True, "dgpo: the samples of a group are noised with the same noise")
    clip_dsm: bool = setting(True, "dgpo: PPO-style clipping of each sample's flow-matching error against the "
                             "fast old-policy EMA's (clip_range)")
    clip_kl: bool = setting(False, "dgpo: the clip_dsm mask also stops the KL penalty's gradient")
    crd_beta: float = setting(1.0, "crd: scale of the implicit reward matched to the centered external one", gt=0)
    crd_loss_type: Literal["mse", "bce"] = setting("mse", "crd: squared error (mse) or binary cross-entropy (bce) "
                                                   "between the centered implicit and external rewards")
    use_old_for_loss: bool = setting(True, "crd: the implicit reward compares with the old model (a slow copy of "
                                     "the weights, old_model_decay); false = with the frozen reference")
    adaptive_logp: bool = setting(True, "crd: each sample's squared errors are divided by its mean absolute error")
    weight_temp: float = setting(-1.0, "crd: centering temperature; < 0 = one uniform mean, 0 = the means over "
                                 "the positive and the negative advantages, > 0 = softmax(+-q / T) weights")
    old_model_decay: str = setting(
        "0-0.25-0.005-0.999", "crd: decay of the old model per epoch, 'start_step-start_value-slope-end_value' "
        "over optimizer steps, or a preset (0-6, none, slow, medium, offline, fast, moderate)")
    sampling_model_decay: str = setting(
        "75-0.0-0.0075-0.999", "crd: decay of the model the rollout samples with, same format as old_model_decay")
    reward_adaptive_kl: bool = setting(True, "crd: each sample's KL is weighted by 1e-4 / kl_beta + q (1 - "
                                       "1e-4 / kl_beta), q its advantage mapped onto [0, 1]")
    kl_cfg: float = setting(
        1.0, "dgpo, crd: CFG scale of the frozen reference's velocity (dgpo: its preference reference and KL; crd: "
        "its KL teacher); values <= 1 = the policy's own guidance_scale (crd: 4.5 when omitted)", ge=0)
    use_ema_ref: bool = setting(False, "dgpo: the group preference compares with the fast old-policy EMA (ema_ref) "
                                "instead of the frozen starting weights")
    switch_ema_ref: NonNegativeInt | None = setting(
        200, "dgpo: after this many optimizer steps the rollouts sample with the fast old-policy EMA (when clip_dsm, "
        "clip_kl or use_ema_ref keeps one); null = never")
    ema_ref_max_decay: float = setting(0.3, "dgpo: the fast old-policy EMA moves after optimizer step k (0-based) "
                                       "with decay min(ema_ref_max_decay, ema_ref_ramp_rate k)", ge=0, le=1)
    ema_ref_ramp_rate: float = setting(0.001, "dgpo: the fast old-policy EMA's decay grows by this per optimizer "
                                       "step, up to ema_ref_max_decay", ge=0)
    ema_ref_device: Literal["cpu", "cuda", "same"] = setting(
        "same", "dgpo: where the fast old-policy EMA's weights live: cpu, cuda, or same (as the model)")
    num_train_timesteps: PositiveInt | None = setting(
        None, "training timesteps per micro-batch (decoupled); null = num_inference_steps x the timestep_range span "
        "(dpo: 1 when omitted)")
    time_sampling_strategy: Literal["uniform", "logit_normal", "discrete", "discrete_with_init",
                                    "discrete_wo_init"] = setting(
        "discrete", "how the decoupled algorithms draw training sigmas: uniform, logit_normal (continuous) or "
        "discrete, discrete_with_init, discrete_wo_init (the rollout's own sigmas); dpo: logit_normal when omitted")
    time_shift: float | None = setting(
        None, "shift s of continuous (uniform, logit_normal) training sigmas, u -> s u / (1 + (s - 1) u); 1 = none; "
        "null = 3 for nft and awm, 1 for dpo. The discrete strategies use the rollout's own (shifted) sigmas", gt=0)
    timestep_range: float | list[float] = setting(
        0.9, "fraction of the denoising axis trained (decoupled): f = [0, f] (the first f of the trajectory, from "
        "sigma = 1) or [lo, hi]; dpo, crd: 0.99, dgpo: 0.6 when omitted", expects="a number in (0, 1] or [lo, hi] with 0 <= lo < hi <= 1")
    off_policy: bool = setting(False, "sample rollouts with the EMA weights while the current policy trains")
    rollout_cache: Literal["none", "first_block", "faster", "pyramid", "taylorseer", "magcache"] = setting(
        "none", "decoupled algorithms: lossy feature caching of the rollouts through diffusers' cache hooks "
        "(FirstBlockCache, FasterCache, Pyramid Attention Broadcast, TaylorSeer, MagCache), removed before "
        "training and evaluation; none = exact rollouts")
    rollout_cache_params: dict = setting(
        default_factory=dict, description="options of the rollout_cache policy's diffusers config (first_block: "
        "threshold, 0.05 by default)")

    ema_decay: float = setting(0.995, "EMA decay of the trained weights (the maximum, for ramped schedules); "
                               "0 = no EMA", ge=0, lt=1)
    ema_decay_schedule: Literal["constant", "power", "linear", "piecewise_linear", "cosine",
                                "warmup_cosine"] = setting(
        "power", "how the EMA decay moves over epochs: constant, power, linear, piecewise_linear, cosine, "
        "warmup_cosine")
    flat_steps: NonNegativeInt = setting(
        0, "piecewise_linear / warmup_cosine: epochs with decay 0 (the EMA copies the policy) before the ramp")
    ramp_rate: float = setting(0.001, "piecewise_linear: decay added per epoch after flat_steps", gt=0)
    warmup_steps: NonNegativeInt | None = setting(
        None, "Flow-Factory compatibility: its EMA warm-up length, read as our key of the same meaning (linear: "
        "piecewise_linear with ramp_rate ema_decay / warmup_steps; warmup_cosine: flat_steps); kept only where "
        "the schedule has no warm-up, where it does nothing")
    ema_update_interval: PositiveInt = setting(10, "update the EMA every this many epochs")
    ema_device: Literal["cpu", "cuda", "same"] = setting("same", "where the EMA weights live; cpu keeps "
                                                         "accelerator memory free")
    enable_gradient_checkpointing: bool = setting(
        False, "trade compute for memory in the transformer (every block; also {mode: full} or {mode: none})")
    shuffle_samples: bool = setting(True, "shuffle the rollouts before each inner epoch of training")
    reward_optimization_overlap: bool = setting(
        False, "optimise while the async rewards (async_reward: true) are still scored: each training micro-batch "
        "starts once every group it draws from is scored, in the order and with the accumulation of a run without "
        "overlap, so the update is the same; needs global_std: false, advantage_aggregation: sum, one process and "
        "an algorithm whose training units do not depend on the advantages (not dpo)")
    reward_optimization_overlap_mode: Literal["ordered", "ready"] = setting(
        "ordered", "Flow-Factory's order of the overlapped micro-batches; here always ordered (the order without "
        "overlap): its ready, an order set by which rewards come in first, is read as ordered, with a note")
    reward_optimization_overlap_poll_interval: float = setting(
        0.05, "Flow-Factory compatibility: its seconds between reward-readiness polls; here the loop waits on the "
        "rewards themselves, so it changes nothing", gt=0)
    latent_storage_dtype: Literal["float16", "bfloat16", "float32"] | None = setting(
        "float16", "precision the rollouts' trajectories are kept in (fp16: half the bytes of fp32; the rollout "
        "integrates on the stored values, so training sees exactly what was sampled); null = the model's dtype")
    steps_per_call: PositiveInt | Literal["all"] = setting(
        1, "trained steps of a micro-batch (the SDE window's steps for the GRPO family, the drawn timesteps "
        "for nft / awm / dpo / dgpo / crd) that go through the transformer in one call; the loss and gradients "
        "equal one call per step, but activations for steps x per_device_batch_size samples are held at once: "
        "more is faster where memory allows; all = every step of a micro-batch")
    offload_samples_to_cpu: bool = setting(
        False, "keep each epoch's rollouts in CPU memory and move one micro-batch at a time to the device")
    seed: int | None = setting(None, "training seed; null = the top-level seed")

    @field_validator("resolution", "condition_image_size", mode="before")
    @classmethod
    def _resolution(cls, value):
        return check_resolution(value)

    @field_validator("enable_gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing_mode(cls, value):
        # Flow-Factory's selective policy: the whole-model modes have a meaning here
        if isinstance(value, dict) and set(value) == {"mode"} and value["mode"] in ("full", "none"):
            return value["mode"] == "full"
        if isinstance(value, dict):
            raise problem(f"{show(value)}: only {{mode: full}} or {{mode: none}} (every block or none) here; "
                          "selective checkpointing is not in this version")
        return value

    @field_validator("old_model_decay", "sampling_model_decay", mode="before")
    @classmethod
    def _decay(cls, value):
        try:
            parse_decay(value)
        except ValueError as err:
            raise problem(str(err)) from None
        return str(value)

    @field_validator("num_train_timesteps", mode="before")
    @classmethod
    def _zero_is_derived(cls, value):
        return None if value == 0 and not isinstance(value, bool) else value  # Flow-Factory: 0 = derive it

    @field_validator("ref_param_device", "ema_device", "ema_ref_device", mode="before")
    @classmethod
    def _device_spelling(cls, value):
        return canonical_choice(value, {"same_as_model": "same", "same": "same", "cpu": "cpu", "cuda": "cuda",
                                        "gpu": "cuda"})

    @field_validator("latent_storage_dtype", mode="before")
    @classmethod
    def _dtype_spelling(cls, value):
        return canonical_choice(value, DTYPE_NAMES)

    @field_validator("timestep_range", mode="before")
    @classmethod
    def _timestep_range(cls, value):
        value = as_list(value)
        if isinstance(value, list):
            if len(value) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                raise problem(f"expected [lo, hi], got {show(value)}")
            lo, hi = (float(v) for v in value)
            if not 0 <= lo < hi <= 1:
                raise problem(f"needs 0 <= lo < hi <= 1, got {show(value)}")
            return [lo, hi]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 < value <= 1:
            raise problem(f"a fraction of the trajectory in (0, 1], got {show(value)}")
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("adam_betas", mode="before")
    @classmethod
    def _betas_list(cls, value):
        value = as_list(value)
        if isinstance(value, list) and len(value) != 2:
            raise problem(f"expected [beta1, beta2], got {show(value)}")
        return value

    @field_validator("adam_betas")
    @classmethod
    def _betas_range(cls, value):
        if value is not None and not all(0 <= b < 1 for b in value):
            raise problem(f"each beta must be in [0, 1), got {show(value)}")
        return value

    @model_validator(mode="after")
    def _name_teachers(self):
        for i, teacher in enumerate(self.teachers):  # upstream's default names
            teacher.name = teacher.name if teacher.name is not None else f"opd_teacher_{i}"
        return self

    @model_validator(mode="after")
    def _read_adam_betas(self):
        if self.adam_betas is None:
            return self
        b1, b2 = self.adam_betas
        for name, given in (("adam_beta1", b1), ("adam_beta2", b2)):
            if name in self.model_fields_set and getattr(self, name) != given:
                raise problem(f"adam_betas {show(self.adam_betas)} contradicts {name}: "
                              f"{getattr(self, name)}; keep one of the two spellings")
        self.adam_beta1, self.adam_beta2 = b1, b2
        self.adam_betas = None
        return self

    @property
    def height_width(self) -> tuple[int, int]:
        return resolution_pair(self.resolution)

    @property
    def betas(self) -> tuple[float, float]:
        return (self.adam_beta1, self.adam_beta2)

    @property
    def conditioning_guidance_scale(self) -> float:
        """The guidance scale training prompts are encoded for: a loss at ``train_guidance_scale``, or a
        reference called with CFG at ``kl_cfg`` (dgpo, crd) or ``kl_guidance_scale`` (dppo), needs the negative
        branch even when the rollouts sample without it."""
        scales, keys = [self.guidance_scale, self.loss_guidance_scale], ALGORITHM_SPECS[self.trainer_type].keys
        if "kl_cfg" in keys and self.kl_cfg > 1:
            scales.append(self.kl_cfg)
        if "kl_guidance_scale" in keys and self.kl_beta > 0 and self.kl_guidance_scale is not None:
            scales.append(self.kl_guidance_scale)
        if self.trainer_type in DISTILLATION_SPECS and self.real_guidance_scale is not None:
            scales.append(self.real_guidance_scale)  # the teacher's guided score
        scales += [t.guidance_scale for t in self.teachers if t.guidance_scale is not None]  # diffusion-opd's
        return max(scales)

    @property
    def loss_guidance_scale(self) -> float:
        """The CFG scale of the velocity the loss trains: ``train_guidance_scale``, else the rollouts'."""
        return self.guidance_scale if self.train_guidance_scale is None else self.train_guidance_scale
