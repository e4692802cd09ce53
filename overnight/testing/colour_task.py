"""A task whose answer depends on the picture, for nights on a vision-language model.

Each day an agent shows pictures it never showed before (a random shade of red or of
blue, a random size), asks "Which colour?" and posts a reward read from the reply's
letters: for a red picture the share of them in the first half of the alphabet (a-m),
for a blue one the share in the second (n-z). A model that ignores the picture earns
about 0.5 on average whatever it writes (moving its letters one way gains on one colour
what it loses on the other); only one that answers red and blue pictures differently
earns more. Letters, not words: a random model writes letters of both halves, so every
group has a spread to learn from.

bench/vision_nights.py runs it for many nights (BENCHMARKS.md); tests/test_vision.py for
a few, on the vLLM its other tests share.
"""

from __future__ import annotations

import base64
import io
import random
import statistics
from dataclasses import dataclass

COLOURS = ("red", "blue")
QUESTION = "Which colour?"


def picture(colour: str, rng: random.Random) -> bytes:
    """A PNG of one random shade of `colour`, of a random size."""
    from PIL import Image

    shade = rng.randint(150, 255)
    low = (rng.randint(0, 80), rng.randint(0, 80))
    rgb = (shade, *low) if colour == "red" else (low[0], low[1], shade)
    out = io.BytesIO()
    Image.new("RGB", (rng.randint(40, 120), rng.randint(40, 120)), rgb).save(out, "PNG")
    return out.getvalue()


def first_half_share(text: str) -> float:
    """The share of the reply's letters in a-m (0.5 for a reply with no letter)."""
    letters = [c for c in text.lower() if "a" <= c <= "z"]
    return sum(c <= "m" for c in letters) / len(letters) if letters else 0.5


def reward(colour: str, text: str) -> float:
    share = first_half_share(text)
    return share if colour == "red" else 1.0 - share


@dataclass
class Day:
    reward: float  # the mean reward of the day's replies
    red: float  # the a-m share of the replies about red pictures
    blue: float  # and about blue ones

    @property
    def gap(self) -> float:
        """How differently red and blue pictures are answered (0 without the picture)."""
        return self.red - self.blue


async def day(
    proxy, tag: str, groups: int, size: int, rng: random.Random, max_tokens: int = 1
) -> Day:
    """One day through the proxy (an aiohttp test client): `groups` new pictures, red
    and blue in turn, each asked `size` times as one rollout group, each reply rewarded
    and finished."""
    shares: dict[str, list[float]] = {c: [] for c in COLOURS}
    rewards = []
    for g in range(groups):
        colour = COLOURS[g % 2]
        url = "data:image/png;base64," + base64.b64encode(picture(colour, rng)).decode()
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTION}]}]  # fmt: skip
        for i in range(size):
            rollout = f"{tag}-{g}.{i}"
            r = await proxy.post(
                "/v1/chat/completions",
                headers={"X-Rollout-Group": f"{tag}-{g}", "X-Rollout-Id": rollout},
                json={"model": "policy", "messages": messages, "max_tokens": max_tokens,
                      "temperature": 1.0, "top_k": 50},
            )  # fmt: skip
            if r.status != 200:
                raise RuntimeError(f"the proxy answered {r.status}: {await r.text()}")
            text = (await r.json())["choices"][0]["message"]["content"] or ""
            shares[colour].append(first_half_share(text))
            rewards.append(reward(colour, text))
            await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": rewards[-1]})
            await proxy.post(f"/v1/rollouts/{rollout}/finish")
    return Day(
        statistics.fmean(rewards), statistics.fmean(shares["red"]), statistics.fmean(shares["blue"])
    )
