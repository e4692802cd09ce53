"""What a judge that sees gets: the pictures its prompt names.

RULER's prompt is text (ruler.py): each image of a trajectory is a placeholder that names
it, `[image sha256:<16 hex>]` (trajectories.py). A judge model that sees images
(`--judge-images auto`: where litellm says the model supports vision; `on`; `off`) gets,
after the text, each image the fitted prompt still names, once, under its label, read
back from the image store and verified. An image given by URL stays a placeholder: the
judge's provider is never asked to fetch what the agent pointed vLLM at. An image the
store no longer has (pruned, damaged) stays a placeholder, and the text says so.

The prompt's token budget (budget.py) counts the text only; each picture adds what the
judge's provider charges for it.
"""

from __future__ import annotations

from dataclasses import replace

from overnight.config import JudgeConfig
from overnight.storage.images import ImageDamaged, ImageMissing, ImageStore
from overnight.storage.read.images import image_of, restore_images

from .ruler import Prompt
from .trajectories import Group, image_label


def sees_images(config: JudgeConfig) -> bool:
    """Whether the judge gets the pictures (`config.images`; auto: litellm's word)."""
    if config.images != "auto":
        return config.images == "on"
    from . import import_litellm

    try:
        return bool(import_litellm().supports_vision(model=config.model))
    except Exception:  # litellm knows nothing of a local model: it sees text
        return False


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
