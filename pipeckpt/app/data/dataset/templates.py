"""The chat template a run renders conversations with: the tokenizer's own, a built-in one by name,
or a Jinja file, as ``data.chat_template`` says.

Why built-ins: a base model's tokenizer often has no template, and fine-tuning it into a chat model
needs one; ChatML is the format most chat models were tuned on. Its markers are written as text, so a
tokenizer that lacks them as special tokens still reads them (as several tokens) and the vocabulary,
so the model's embedding, is left as it is.
"""

from pathlib import Path
from typing import Any, Optional

from pipeckpt._errors import config_error

__all__ = ["BUILT_IN", "chat_template"]

BUILT_IN = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}


def chat_template(setting: Optional[str], tokenizer: Any, tokenizer_dir: str) -> str:
    """The Jinja text of ``setting``: None (the tokenizer's own), a name of :data:`BUILT_IN`, or a
    Jinja file's path; a tokenizer without a template, with ``setting`` None, is refused by name."""
    if setting is None:
        own = getattr(tokenizer, "chat_template", None)
        if not isinstance(own, str) or not own:
            raise config_error(
                f"data.chat_template=null with the tokenizer of {tokenizer_dir}",
                "a chat is rendered by a chat template, and this tokenizer has none",
                f"set data.chat_template to a built-in ({', '.join(BUILT_IN)}) or a Jinja file's path",
            )
        return own
    if setting in BUILT_IN:
        return BUILT_IN[setting]
    file = Path(setting).expanduser()
    if not file.is_file():
        raise config_error(
            f"data.chat_template={setting}",
            f"it is neither a built-in template ({', '.join(BUILT_IN)}) nor a file",
            "name a built-in template, or a Jinja file's path (as a tokenizer's chat_template holds it)",
        )
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise config_error(
            f"data.chat_template={setting}", "the file is not UTF-8 text", "write the template as UTF-8"
        ) from None
