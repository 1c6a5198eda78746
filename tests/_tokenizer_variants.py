"""Tokenizer-only checkpoint directories that exercise the parts of the tokenizer files that the demo tokenizer leaves
out: a BOS-adding post-processor with AddedToken dicts, special_tokens_map.json, added_tokens_decoder flags that
override tokenizer.json, missing special tokens, named chat templates, chat_template.jinja as transformers 5 saves it,
and a WordPiece vocabulary with clean_up_tokenization_spaces. Each builder writes into `out` and returns it.
"""
from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from radixserve.bench.demo_kit.corpus import corpus
from radixserve.bench.demo_kit.tokenizer import CHAT_TEMPLATE, build_tokenizer, tokenizer_json

# Llama-2 style, written with plain {% %} blocks over indented lines so that trim_blocks/lstrip_blocks matter, and
# with namespace, loop controls, tojson options, dict(), raise_exception and strftime_now.
LLAMA_STYLE_TEMPLATE = """\
{% set ns = namespace(system='', seen=0) %}
{% macro text(content) %}
    {% if content is string %}{{ content }}{% elif content is iterable %}
        {% for part in content %}{{ part['text'] }}{% endfor %}
    {% endif %}
{% endmacro %}
{% if messages[0]['role'] == 'system' %}
    {% set ns.system = text(messages[0]['content']) %}
{% endif %}
{{ bos_token }}
{% if tools %}
[AVAILABLE_TOOLS]{{ tools | tojson(indent=1, sort_keys=True) }}[/AVAILABLE_TOOLS]
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if ns.seen > 40 %}{% break %}{% endif %}
    {% set ns.seen = ns.seen + 1 %}
    {% if message['role'] == 'user' %}
[INST] {% if ns.system and ns.seen == 1 %}<<SYS>>{{ ns.system }}<</SYS>> {% endif %}{{ text(message['content']) | trim }} [/INST]
    {% elif message['role'] == 'assistant' %}
 {{ text(message['content'] or '') }}{% if message['tool_calls'] is defined %}{{ message['tool_calls'] | tojson }}{% endif %} {{ eos_token }}
    {% elif message['role'] == 'tool' %}
[TOOL_RESULT]{{ dict(id=message.get('tool_call_id'), content=message['content']) | tojson }}[/TOOL_RESULT]
    {% else %}
{{ raise_exception('unsupported role ' + message['role']) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ ' ' }}{% endif %}
{% if date_string is defined %}({{ date_string }}){% else %}({{ strftime_now('%Y') | length }}){% endif %}"""

SIMPLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
    "{% if add_generation_prompt %}assistant:{% endif %}"


def qwen3_style_template() -> str:
    """The demo ChatML template made Qwen3-like: an assistant turn's reasoning (reasoning_content) is rendered as
    `<think>...</think>` before its content, and `enable_thinking=False` closes an empty block in the generation
    prompt (the model then answers without thinking)."""
    out = CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' + text_of(message['content']) -}}",
        "{{- '<|im_start|>assistant\\n' -}}{%- if message['reasoning_content'] -%}"
        "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}{%- endif -%}"
        "{{- text_of(message['content']) -}}")
    out = out.replace(
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
        "{%- endif -%}")
    if out.count("enable_thinking") != 2 or "reasoning_content" not in out:
        raise AssertionError("the demo chat template changed; update qwen3_style_template")
    return out


def _write_json(out: str, name: str, body: dict) -> None:
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2, ensure_ascii=False)


def _added(content: str, **flags) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, **flags}


def build_bos_dicts(out: str) -> str:
    """<s> prepended by the post-processor; bos_token/unk_token as AddedToken dicts; no pad token."""
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer.from_str(tokenizer_json(512))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<unk>")])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(os.path.join(out, "tokenizer.json"))
    _write_json(out, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _added("<s>"), "eos_token": "</s>",
        "unk_token": _added("<unk>"), "add_bos_token": True, "chat_template": LLAMA_STYLE_TEMPLATE,
    })
    _write_json(out, "generation_config.json", {"eos_token_id": 2})
    return out


def build_legacy_map(out: str) -> str:
    """No added_tokens_decoder: special_tokens_map.json names eos (a dict), a pad token missing from the vocabulary
    (so it is added) and additional special tokens that tokenizer.json keeps as ordinary added tokens."""
    build_tokenizer(out, 1024)
    config = json.loads(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8").read())
    for key in ("eos_token", "pad_token"):
        config.pop(key)
    _write_json(out, "tokenizer_config.json", config)
    _write_json(out, "special_tokens_map.json", {
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "pad_token": "<pad>", "additional_special_tokens": ["<tool_call>", "</tool_call>"],
    })
    return out


def build_declared(out: str) -> str:
    """added_tokens_decoder marks <tool_call> special (tokenizer.json does not); a model-specific image_token and an
    extra special token that the vocabulary lacks; split_special_tokens; default + tool_use named templates."""
    build_tokenizer(out, 2048)
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    decoder = {}
    for idx, token in tok.get_added_tokens_decoder().items():
        decoder[str(idx)] = {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                             "rstrip": token.rstrip, "single_word": token.single_word,
                             "special": token.special or token.content == "<tool_call>"}
    config = json.loads(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8").read())
    config.update(added_tokens_decoder=decoder, image_token="<image>", extra_special_tokens=["<extra_0>"],
                  split_special_tokens=True, chat_template=[
                      {"name": "default", "template": CHAT_TEMPLATE},
                      {"name": "tool_use", "template": "{{- '[tool_use:' ~ image_token ~ ']' -}}" + CHAT_TEMPLATE},
                  ])
    _write_json(out, "tokenizer_config.json", config)
    return out


def build_wordpiece(out: str) -> str:
    """A WordPiece vocabulary ([CLS] $A [SEP]) whose decode applies clean_up_tokenization_spaces."""
    os.makedirs(out, exist_ok=True)
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus().splitlines(), trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials,
                                                                              show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    tok.save(os.path.join(out, "tokenizer.json"))
    _write_json(out, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "cls_token": "[CLS]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]", "clean_up_tokenization_spaces": True,
        "chat_template": SIMPLE_TEMPLATE,
    })
    return out


def save_with_transformers(src: str, out: str) -> str:
    """transformers 5 save_pretrained: chat_template.jinja (and additional_chat_templates/<name>.jinja)."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(out)
    return out
