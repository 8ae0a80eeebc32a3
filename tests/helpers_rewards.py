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
