"""What a judge that sees gets: the pictures its prompt names.

RULER's prompt is text (ruler.py): each image of a trajectory is a placeholder that names
it, `[image sha256:<16 hex>]` (trajectories.py). A judge model that sees images
(`--judge-images auto`: where litellm says the model supports vision; `on`; `off`) gets,
after the text, each image the fitted prompt still names, once, under its label, read
back from the image store and verified. An image given by URL stays a placeholder: the
judge's provider is never asked to fetch what the agent pointed vLLM at. An image the
store no longer has (pruned, damaged) stays a placeholder, and the text says so.

The prompt's token budget (budget.py) keeps room for the pictures: each one the fitted
text names is counted as IMAGE_TOKENS, and where text and pictures together exceed the
budget the text is fitted again into what the pictures leave (a cut there may name
fewer pictures; never more).
"""

from __future__ import annotations

from dataclasses import replace

from overnight.config import JudgeConfig
from overnight.storage.images import ImageDamaged, ImageMissing, ImageStore
from overnight.storage.read.images import image_of, restore_images

from .budget import Counter
from .ruler import Prompt, prompt_for
from .trajectories import Group, image_label

# What one picture is counted as in the judge's budget: about the most the large
# providers charge for one (Anthropic: width x height / 750 after resizing to at most
# 1.15 megapixels, about 1,600; OpenAI's high detail: 85 + 170 per 512-pixel tile, 765 for
# a 1024x1024, 1,105 for a 2048x768). A provider that charges less loses some text room.
IMAGE_TOKENS = 1_600


def sees_images(config: JudgeConfig) -> bool:
    """Whether the judge gets the pictures (`config.images`; auto: litellm's word)."""
    if config.images != "auto":
        return config.images == "on"
    from . import import_litellm

    try:
        return bool(import_litellm().supports_vision(model=config.model))
    except Exception:  # litellm knows nothing of a local model: it sees text
        return False


def fitted_with_images(
    group: Group, config: JudgeConfig, budget: int | None, counter: Counter,
    data_dir, store: ImageStore | None = None,
) -> Prompt:  # fmt: skip
    """RULER's prompt for `group` with the pictures it names, the text fitted into what
    the pictures leave of `budget` (None: no budget, nothing fitted)."""
    prompt = prompt_for(group, config, budget, counter)
    if budget is not None:
        pictures = len(_named_images(group, prompt.messages[1]["content"])) * IMAGE_TOKENS
        # Where the pictures would leave the text less than a quarter of the budget the
        # text keeps the whole of it: cut to nothing it judges nothing; sent, the judge's
        # provider decides (a prompt over its window is its own error, recorded).
        if pictures and budget - pictures >= budget // 4:
            text = prompt.cut.tokens_after if prompt.cut else counter.count(prompt.messages)
            if text + pictures > budget:
                prompt = prompt_for(group, config, budget - pictures, counter)
    return with_images(prompt, group, data_dir, store)


def with_images(prompt: Prompt, group: Group, data_dir, store: ImageStore | None = None) -> Prompt:
    """`prompt` with the pictures its text names, each once, under its label."""
    system, user = prompt.messages
    text = user["content"]
    shown = _named_images(group, text)
    if not shown:
        return prompt
    store = store or ImageStore(data_dir)
    parts, missing = [{"type": "text", "text": text}], []
    for label, part in shown:
        try:
            url = _data_url(restore_images(part, data_dir, store))
        except (ImageMissing, ImageDamaged):
            missing.append(label)
            continue
        parts += [{"type": "text", "text": label}, {"type": "image_url", "image_url": {"url": url}}]
    if missing:
        parts.append({"type": "text", "text": f"Not available: {', '.join(missing)}."})
    return replace(prompt, messages=[system, {"role": "user", "content": parts}])


def _named_images(group: Group, text: str) -> list[tuple[str, dict]]:
    """(label, part) of each stored or inline image the text names, in the text's order."""
    found: dict[str, dict] = {}
    for trajectory in group.trajectories:
        for message in trajectory.messages:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else ():
                image = image_of(part)
                if image is None or image.kind == "url":  # a URL is never fetched for it
                    continue
                label = image_label(part)
                if label in text and label not in found:
                    found[label] = part
    return sorted(found.items(), key=lambda item: text.index(item[0]))


def _data_url(part: dict) -> str:
    """A restored part's picture as a data URL (the proxy records every API's images in
    the chat shape: an `image_url` part; a Responses part has the URL itself)."""
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url
