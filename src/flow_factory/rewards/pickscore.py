"""PickScore (Kirstain et al. 2023): a CLIP-H fine-tuned on human preferences.

Score as flow_grpo scales it: ``logit_scale * cos(text, image) / 26`` (26 brings the
usual range of about 18-23 near 1). ``PickScore_Rank`` is its groupwise form, as
Flow-Factory's: each sample's rank by PickScore within its group, divided by the group
size (0 for the worst, (n-1)/n for the best), which ignores how far apart the scores are.
"""

from __future__ import annotations

import torch

from .base import GroupwiseRewardModel, PointwiseRewardModel, RewardModelOutput
from .clip_common import flatten_media, image_embeddings, load_clip, mean_per_sample, text_embeddings

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


class _PickScorer:
    """The scoring both PickScore rewards share; mixed into each."""

    required_fields = ("prompt", "image", "video")
    SCALE = 26.0  # flow_grpo's divisor

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 16, processor_name_or_path: str | None = None):
        # super(): the reward base each class mixes this into
        super().__init__(model_name_or_path, device, dtype, batch_size)
        self.model_name_or_path, processor = self.models_to_load({"model_name_or_path": model_name_or_path,
                                                                  "processor_name_or_path": processor_name_or_path})
        load_clip(self, self.model_name_or_path, processor)

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        """[model, processor]: the hub checkpoint ships no processor of its own and uses LAION's CLIP-H one;
        a local folder is expected to hold both (save_pretrained of model and processor)."""
        model = options.get("model_name_or_path") or PICKSCORE_MODEL
        processor = options.get("processor_name_or_path") or (PICKSCORE_PROCESSOR if model == PICKSCORE_MODEL
                                                              else model)
        return [model, processor]

    def pickscores(self, prompt: list[str], image, video) -> torch.Tensor:
        pictures, owner = flatten_media(type(self).__name__, image, video)
        img = image_embeddings(self, pictures)
        txt = text_embeddings(self, list(prompt))[owner]
        scale = self.model.logit_scale.exp().float().cpu()
        per_picture = scale * (img * txt.to(img.device)).sum(-1).cpu() / self.SCALE
        return mean_per_sample(per_picture, owner, len(prompt))


class PickScore(_PickScorer, PointwiseRewardModel):
    def __call__(self, prompt, image=None, video=None) -> RewardModelOutput:
        return RewardModelOutput(rewards=self.pickscores(prompt, image, video))


class PickScoreRank(_PickScorer, GroupwiseRewardModel):
    def __call__(self, prompt, image=None, video=None) -> RewardModelOutput:
        n = len(prompt)
        # the group may be larger than batch_size: score it in chunks, rank the whole group
        scores = torch.cat([
            self.pickscores(prompt[i:i + self.batch_size],
                            None if image is None else image[i:i + self.batch_size],
                            None if video is None else video[i:i + self.batch_size])
            for i in range(0, n, self.batch_size)])
        ranks = scores.argsort(stable=True).argsort()
        return RewardModelOutput(rewards=ranks.float() / n, extra_info={"pickscore": scores})
