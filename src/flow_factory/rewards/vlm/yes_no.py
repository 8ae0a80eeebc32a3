"""``vllm_evaluate``: ask the VLM a Yes/No question about each image; the reward is the
probability of Yes against No read from the first generated token's top logprobs,
``P(yes) / (P(yes) + P(no))``, in [0, 1]. Every top token that is "yes" after stripping
spaces and lower-casing (``Yes``, `` yes``, ``YES``) adds to P(yes); likewise for no.

A reply whose top logprobs hold neither gets ``fallback_score`` (or stops the run when
it is null); so does a reply without logprobs (a server started without them).
"""

from __future__ import annotations

import math
from typing import Any

from .base import UnscorableReply, VLMJudge, image_part

DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer Yes or No.'


def yes_probability(body: Any) -> float:
    try:
        top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        pairs = [(str(t["token"]), float(t["logprob"])) for t in top]
    except (KeyError, IndexError, TypeError, ValueError):
        raise UnscorableReply(f"no choices[0].logprobs.content[0].top_logprobs with token/logprob pairs in "
                              f"{str(body)[:200]!r}") from None
    p = {"yes": 0.0, "no": 0.0}
    for token, logprob in pairs:
        word = token.strip().lower()
        if word in p:
            p[word] += math.exp(logprob)
    if p["yes"] + p["no"] == 0.0:
        raise UnscorableReply(f"neither Yes nor No among the top tokens {[t for t, _ in pairs]}")
    return p["yes"] / (p["yes"] + p["no"])


class YesNoJudge(VLMJudge):
    required_fields = ("prompt", "image")

    def __init__(self, *args, question: str = DEFAULT_QUESTION, top_logprobs: int = 20, **kwargs):
        super().__init__(*args, **kwargs)
        if "{prompt}" not in question:
            raise ValueError(f"vllm_evaluate: question must contain '{{prompt}}', got {question!r}")
        self.question, self.top_logprobs = question, int(top_logprobs)

    def __call__(self, prompt, image=None):
        if image is None:
            raise ValueError("vllm_evaluate needs images")

        def one(i: int) -> float:
            body = self.chat([image_part(image[i]), {"type": "text", "text": self.question.format(prompt=prompt[i])}],
                             max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=self.top_logprobs)
            return yes_probability(body)

        return self.score_each(len(prompt), one)
