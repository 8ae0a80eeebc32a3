"""Rewards that misbehave on cue, named in test configs by class path (``helpers_rewards.Brightness``).

``Brightness`` scores an image by its mean pixel value (smooth, unlike JPEG size). Before a
run, a test sets ``Brightness.plan``: the 0-based call number -> what that call does
(``"nan"`` / ``"inf"``: the first sample of that call scores so; ``"sigint"`` / ``"sigterm"``:
the process signals itself mid-sampling). ``Brightness.calls`` counts calls.
"""

import os
import signal

from flow_factory.rewards import PointwiseRewardModel, RewardModelOutput


class Brightness(PointwiseRewardModel):
    required_fields = ("image",)
    use_tensor_inputs = True
    plan: dict = {}
    calls = 0

    def __call__(self, prompt=None, image=None, video=None, condition_images=None, condition_videos=None):
        action = Brightness.plan.get(Brightness.calls, "always" in Brightness.plan and Brightness.plan["always"])
        Brightness.calls += 1
        rewards = image.float().mean(dim=(1, 2, 3))
        if action in ("nan", "inf"):
            rewards[0] = float(action)
        elif action in ("sigint", "sigterm"):
            os.kill(os.getpid(), signal.SIGINT if action == "sigint" else signal.SIGTERM)
        return RewardModelOutput(rewards=rewards)


def reset(plan: dict | None = None) -> None:
    Brightness.plan, Brightness.calls = dict(plan or {}), 0


# Rewards the multi-process tests name by class path. They live in this light module because ff-train
# imports a reward class in the process the user started, to check its models before anything launches:
# a test module's own imports would cost every launch seconds.


class MeanBrightness(PointwiseRewardModel):
    """The mean pixel value. Smooth in the image: samples that differ by rounding get rewards that differ by
    rounding; JPEG size quantises to bytes and can turn 1e-7 into a different reward (and advantage)."""

    required_fields = ("image",)
    use_tensor_inputs = True

    def __call__(self, prompt=None, image=None, video=None, condition_images=None, condition_videos=None):
        return RewardModelOutput(rewards=image.float().mean(dim=(1, 2, 3)))


class MeanVideoBrightness(PointwiseRewardModel):
    """``MeanBrightness`` for videos."""

    required_fields = ("video",)
    use_tensor_inputs = True

    def __call__(self, prompt=None, image=None, video=None, condition_images=None, condition_videos=None):
        return RewardModelOutput(rewards=video.float().mean(dim=(1, 2, 3, 4)))


class BrightnessAndANaNLoss(MeanBrightness):
    """``MeanBrightness``; and, in process 1 alone, the run's first GRPO loss NaN (test_run_safety's
    non-finite gradient, set up in the launched process as its rewards load). So process 1's gradient of
    epoch 1's one optimizer step is NaN, and once reduced every process's is; process 0, which writes the
    history, saw finite losses only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from helpers_algorithms import nan_on_first_call

        from flow_factory.algorithms.grpo import GRPO

        if os.environ.get("RANK") != "1" or hasattr(GRPO.loss, "nan_once"):
            return
        GRPO.loss = nan_on_first_call(GRPO.loss)
        GRPO.loss.nan_once = True


class FailsOnProcessOne(PointwiseRewardModel):
    """Fails to build on process 1 only: process 0 goes on and waits for it, until the launch stops it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.environ.get("RANK") == "1":
            raise ValueError("FailsOnProcessOne: the judge's weights are corrupt")
