"""Which chat template a student trains on: its own with {% generation %} markers, TRL's training variant, or one
named in pipelines.yaml; otherwise an error that names the detected family and how to supply a template."""

from __future__ import annotations

import re
from pathlib import Path

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Markers each family's templates write; the model_type of config.json decides first, these when it is unknown.
FAMILY_MARKERS = {
    "qwen": "<|im_start|>", "llama": "<|start_header_id|>", "gemma": "<start_of_turn>", "phi": "<|assistant|>",
    "deepseek": "<｜Assistant｜>", "cohere": "<|START_OF_TURN_TOKEN|>", "mistral": "[INST]",
}


class ChatTemplateError(ValueError):
    """No training-compatible chat template for a student; the message says which family and what to do."""


def has_generation_markers(template: str | None) -> bool:
    """Whether the template marks assistant output with {% generation %} (assistant-only loss needs it)."""
    return isinstance(template, str) and GENERATION_MARKER.search(template) is not None


def detect_family(tokenizer, model_type: str | None = None) -> str:
    """The model family, from config.json's model_type, else from the markers its chat template writes."""
    if model_type:
        for family in FAMILY_MARKERS:
            if model_type.startswith(family):
                return family
        return model_type
    template = _template_text(tokenizer)
    for family, marker in FAMILY_MARKERS.items():
        if marker in template:
            return family
    return "unknown"


def training_template(tokenizer, source: str, model_type: str | None = None,
                      configured: str | Path | None = None) -> str:
    """The template SFT trains on and the saved student ships (so the harness renders the same tokens)."""
    if configured is not None:
        path = Path(configured)
        if not path.is_file():
            raise ChatTemplateError(f"student.chat_template: {path} is not a file (give the path of a .jinja "
                                    "template, relative to the project root)")
        text = path.read_text(encoding="utf-8")
        if not has_generation_markers(text):
            raise ChatTemplateError(f"student.chat_template: {path} has no {{% generation %}} markers: wrap each "
                                    "assistant turn's content and its end-of-turn token in "
                                    "{% generation %}...{% endgeneration %}")
        return text
    own = _template_text(tokenizer)
    if not own:
        raise ChatTemplateError(f"student {source}: the tokenizer has no chat template; set "
                                "student.chat_template in pipelines.yaml to a .jinja file with {% generation %} "
                                "markers")
    if has_generation_markers(own):
        return own
    from trl.chat_template_utils import get_training_chat_template

    try:
        swapped = get_training_chat_template(tokenizer)
    except ValueError:
        family = detect_family(tokenizer, model_type)
        raise ChatTemplateError(
            f"student {source}: model family '{family}' (model_type {model_type or 'unknown'}); its chat template "
            "has no {% generation %} markers and is not one TRL ships a training version of (TRL matches the "
            "original template text exactly). Copy the template to a .jinja file, wrap each assistant turn's "
            "content and end-of-turn token in {% generation %}...{% endgeneration %}, and set "
            "student.chat_template: <path> for this pipeline in pipelines.yaml") from None
    return swapped if swapped is not None else own


def _template_text(tokenizer) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named variants: the default one is what apply_chat_template uses
        template = template.get("default", "")
    return template or ""
