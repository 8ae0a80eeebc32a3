"""Reward names -> reward classes.

A config's ``reward_model`` is either a registered name (case-insensitive, as in
Flow-Factory: ``PickScore`` and ``pickscore`` are the same) or a class path,
``package.module.ClassName`` or ``package.module:ClassName``.

The built-in rewards are the table ``BUILTIN_REWARDS``: a name and where its class is,
as text. Resolving a name imports only that one module, so a run never pays for (or
needs) the dependencies of rewards it does not use: transformers, open_clip, OCR engines.
A reward shipped elsewhere in the package (``shapebench``) is a line of the same table.
A user's own reward needs no registration (give its class path), or registers a short
name with ``@register_reward("name")`` in a module the run imports. Class paths from
Flow-Factory's guide resolve as written: the remote rewards it names under
"flow_factory.rewards.my_reward_remote" are those of ``remote.py``, and the class paths of
its built-in rewards (``flow_factory.rewards.pick_score.PickScoreRewardModel``, ...) are
the built-in rewards here of the same name (``FLOW_FACTORY_CLASS_PATHS``). A built-in of
Flow-Factory's this version lacks is refused with what it is (``NOT_HERE``).
"""

from __future__ import annotations

import difflib

from ..class_path import import_class
from .base import BaseRewardModel, GroupwiseRewardModel, PointwiseRewardModel

# lower-cased name -> "module:Class"; adding a built-in reward is adding its line here
BUILTIN_REWARDS: dict[str, str] = {
    "pickscore": "flow_factory.rewards.pickscore:PickScore",
    "pickscore_rank": "flow_factory.rewards.pickscore:PickScoreRank",
    "pickscorerank": "flow_factory.rewards.pickscore:PickScoreRank",  # Flow-Factory's other spelling
    "clip": "flow_factory.rewards.clip_score:ClipScore",
    "aesthetic": "flow_factory.rewards.aesthetic:Aesthetic",
    "jpeg_compressibility": "flow_factory.rewards.jpeg_compressibility:JpegCompressibility",
    "ocr": "flow_factory.rewards.ocr:OcrReward",
    "clap": "flow_factory.rewards.clap:ClapScore",  # a soundtrack against its prompt (LTX-2)
    "remote": "flow_factory.rewards.remote:RemotePointwiseRewardModel",
    "remote_groupwise": "flow_factory.rewards.remote:RemoteGroupwiseRewardModel",
    "vllm_evaluate": "flow_factory.rewards.vlm.yes_no:YesNoJudge",
    "rational_rewards_t2i": "flow_factory.rewards.vlm.rubric:RubricT2IJudge",
    "rational_rewards_edit": "flow_factory.rewards.vlm.rubric:RubricEditJudge",
    # the verifiable reward of the ShapeBench benchmark (flow_factory/shapebench)
    "shapebench": "flow_factory.shapebench.reward:ShapeBenchReward",
    "shapebench_strict": "flow_factory.shapebench.reward:ShapeBenchStrictReward",
}

# Flow-Factory's class paths of its built-in rewards (its rewards/registry.py) -> the name of the same reward here
FLOW_FACTORY_CLASS_PATHS = {
    "flow_factory.rewards.pick_score.PickScoreRewardModel": "pickscore",
    "flow_factory.rewards.pick_score.PickScoreRankRewardModel": "pickscore_rank",
    "flow_factory.rewards.clip.CLIPRewardModel": "clip",
    "flow_factory.rewards.clap.CLAPRewardModel": "clap",
    "flow_factory.rewards.ocr.OCRRewardModel": "ocr",
    "flow_factory.rewards.vllm_evaluate.VLMEvaluateRewardModel": "vllm_evaluate",
    "flow_factory.rewards.rational_rewards_t2i.RationalRewardsT2IRewardModel": "rational_rewards_t2i",
    "flow_factory.rewards.rational_rewards_edit.RationalRewardsEditRewardModel": "rational_rewards_edit",
    # its built-ins this version lacks (NOT_HERE)
    "flow_factory.rewards.imagebind_reward.ImageBindRewardModel": "imagebind",
    "flow_factory.rewards.geneval.GenEvalRewardModel": "geneval",
    "flow_factory.rewards.geneval2_soft_tifa.GenEval2SoftTIFARewardModel": "geneval2_soft_tifa",
    "flow_factory.rewards.hpsv2_reward.HPSv2RewardModel": "hpsv2",
    "flow_factory.rewards.qwen_image_bench.reward.QwenImageBenchRewardModel": "qwen_image_bench",
}
# Flow-Factory's built-in rewards this version does not have -> what each is, for the error
_SERVE_IT = ("serve it with ff-reward-server (reward_model: remote) or give your own class's path "
             "(docs/rewards.md)")
NOT_HERE = {
    "imagebind": "ImageBind's audio-video alignment (Meta's imagebind package)",
    "geneval": "GenEval's object-detector check of the prompt's objects, counts, colours and positions",
    "geneval2_soft_tifa": "GenEval 2's soft-TIFA score",
    "hpsv2": "HPSv2's human-preference score (an open_clip ViT-H-14 fine-tune)",
    "qwen_image_bench": "the Qwen-Image-Bench score",
}

# names registered at run time by @register_reward, same form
_USER_REWARDS: dict[str, str] = {}


def register_reward(name: str):
    """Class decorator: make ``name`` usable as ``reward_model`` in a config."""

    def decorate(cls: type) -> type:
        path = f"{cls.__module__}:{cls.__qualname__}"
        key = name.lower()
        taken = registered_rewards().get(key, path)
        if taken != path:
            raise ValueError(f"reward name {name!r} is already registered to {taken}, cannot register {path}")
        _USER_REWARDS[key] = path
        return cls

    return decorate


register_reward_model = register_reward  # Flow-Factory's name of the decorator


def registered_rewards() -> dict[str, str]:
    """Every known name and the class path it stands for."""
    return BUILTIN_REWARDS | _USER_REWARDS


def resolve_reward_class(name_or_path: str | type) -> type[BaseRewardModel]:
    """The reward class a config's ``reward_model`` names.

    Raises ValueError for an unknown name (listing the registered ones), ImportError
    for a class path whose module or attribute cannot be found, TypeError when the
    object found is not a reward model.
    """
    if isinstance(name_or_path, type):
        cls, shown = name_or_path, name_or_path.__qualname__
    else:
        shown = str(name_or_path).strip()
        registry = registered_rewards()
        key = FLOW_FACTORY_CLASS_PATHS.get(shown, shown.lower())
        if key in registry:
            cls = import_class(registry[key], "reward class path")
        elif key in NOT_HERE:
            raise ValueError(f"{shown!r} is Flow-Factory's built-in reward {key} ({NOT_HERE[key]}), which this "
                             f"version does not have; {_SERVE_IT}")
        elif "." in shown or ":" in shown:
            cls = import_class(shown, "reward class path")
        else:
            close = difflib.get_close_matches(shown.lower(), list(registry), n=3, cutoff=0.6)
            raise ValueError(
                f"unknown reward {shown!r}. Registered rewards: {sorted(registry)}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + ". A custom reward is given by its class path, e.g. 'my_package.rewards.MyReward'."
            )
    if not (isinstance(cls, type) and issubclass(cls, BaseRewardModel)):
        raise TypeError(f"reward {shown!r} resolves to {cls!r}, which is not a subclass of "
                        f"PointwiseRewardModel or GroupwiseRewardModel")
    if not issubclass(cls, (PointwiseRewardModel, GroupwiseRewardModel)):
        raise TypeError(f"reward {shown!r} ({cls.__qualname__}) must subclass PointwiseRewardModel "
                        f"or GroupwiseRewardModel, not BaseRewardModel directly")
    return cls
