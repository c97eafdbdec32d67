"""Which chat template a student trains on: its own with {% generation %} markers, a training variant shipped here
(SmolLM2's) or by TRL, or one named in pipelines.yaml; otherwise an error that names the detected family and how
to supply a template."""

from __future__ import annotations

import re
from pathlib import Path

from flywheel.errors import UserFacingError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Markers each family's templates write; the model_type of config.json decides first, these when it is unknown.
FAMILY_MARKERS = {
    "qwen": "<|im_start|>", "llama": "<|start_header_id|>", "gemma": "<start_of_turn>", "phi": "<|assistant|>",
    "deepseek": "<｜Assistant｜>", "cohere": "<|START_OF_TURN_TOKEN|>", "mistral": "[INST]",
}

# SmolLM2-135M/360M/1.7B-Instruct's own template, as its GGUF and tokenizer_config.json carry it: ChatML with a
# default system prompt, no tools, no {% generation %} markers (and not one TRL ships a training version of).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Its training variant: the same text for every message without tool calls (tests/test_templates.py checks it),
# plus what the harness needs: the tools as JSON and how to call them, appended to the system turn; an
# assistant turn's calls written as flywheel.policies.toolcalls.render_tool_call writes them (arguments given as
# a JSON string verbatim: canonical_messages makes them canonical); each assistant turn's content and its
# <|im_end|> inside {% generation %}, so the loss is on them and the student learns to stop.
SMOLLM2_TRAINING_TEMPLATE = (
    "{%- set ns = namespace(tools='') -%}"
    "{%- if tools -%}"
    "{%- set ns.tools = '\n\nYou can call these tools:' -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.tools = ns.tools + '\n' + ((tool.function if tool.function is defined else tool) | tojson) -%}"
    "{%- endfor -%}"
    "{%- set ns.tools = ns.tools + '\nTo call a tool, reply with <tool_call>{\"name\": <tool name>, "
    "\"arguments\": <arguments as a JSON object>}</tool_call>; its result comes back in a tool turn.' -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face' + ns.tools"
    " + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] or '' -}}"
    "{%- if message.tool_calls -%}{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- elif loop.first and message['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' + (message['content'] or '') + ns.tools + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
# A template known here, by its exact text (as TRL matches its own), -> the training variant this project ships.
TRAINING_VARIANTS = {SMOLLM2_TEMPLATE: SMOLLM2_TRAINING_TEMPLATE}


class ChatTemplateError(UserFacingError, ValueError):
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
    if own in TRAINING_VARIANTS:
        return TRAINING_VARIANTS[own]
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
