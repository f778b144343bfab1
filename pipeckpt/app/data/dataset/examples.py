"""One row of the user's data as the model reads it: token ids and labels, the labels -100 on every
token the loss skips (the prompt, the user's and system's turns, unless ``train_on_prompt``).

Formats:
    ``text``: one text column; every token is a label.
    ``prompt_response``: two columns; the prompt's tokens are -100. With a chat template the pair is
        rendered as a user turn and an assistant turn, else joined as written (the prompt carries its
        own separator) with the tokenizer's end-of-sequence token after the response.
    ``chat``: a list of ``{role, content}`` messages rendered by the chat template; only the
        assistant's turns (their content and the template's end-of-turn text) are labels.

Which tokens are the assistant's: the template renders the conversation up to each assistant turn
with the generation prompt, and through that turn; the characters between are the turn's, and a
token is the assistant's when its characters lie there (the fast tokenizer's offsets). Why not
``return_assistant_tokens_mask``: it needs ``{% generation %}`` tags that few templates carry.

A row that cannot be rendered is not raised from inside ``datasets.map``'s worker processes (a
traceback per process); its ``problem`` column says why, and the data module names the first.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["ROLES", "Rendering", "render_row", "tokenizer_of"]

#: The roles a chat message may have.
ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100

_TOKENIZERS: Dict[str, Any] = {}


def tokenizer_of(directory: str) -> Any:
    """The tokenizer saved in ``directory``, loaded once per process (``datasets.map``'s workers each
    load their own), running no code from the directory."""
    if directory not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[directory] = AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )
    return _TOKENIZERS[directory]


class Rendering:
    """How rows become tokens: the settings that ``datasets`` hashes into the cache's key.

    Args:
        tokenizer: the tokenizer's directory.
        tokenizer_key: a digest of its files (a changed tokenizer is another cache).
        format: ``text``, ``prompt_response`` or ``chat``.
        fields: the columns read: ``{"text": ...}``, ``{"prompt": ..., "response": ...}`` or
            ``{"messages": ...}``.
        template: the chat template's Jinja text (None: no template).
        train_on_prompt: labels on every token.
        seq_len: the longest row kept; longer rows are cut there (their ``length`` says how long).
    """

    def __init__(
        self,
        *,
        tokenizer: str,
        tokenizer_key: str,
        format: str,
        fields: Dict[str, str],
        template: Optional[str],
        train_on_prompt: bool,
        seq_len: int,
    ) -> None:
        self.tokenizer, self.tokenizer_key, self.format, self.fields = (
            tokenizer,
            tokenizer_key,
            format,
            fields,
        )
        self.template, self.train_on_prompt, self.seq_len = template, train_on_prompt, seq_len


def _text(value: Any, field: str) -> Tuple[Optional[str], str]:
    if value is None:
        return None, f"it has no {field!r}"
    if not isinstance(value, str):
        return None, f"its {field!r} is a {type(value).__name__}, not text"
    return value, ""


def _messages(value: Any, field: str) -> Tuple[List[Dict[str, str]], str]:
    if value is None:
        return [], f"it has no {field!r}"
    if not isinstance(value, list) or not value:
        return [], f"its {field!r} is not a non-empty list of messages"
    for number, message in enumerate(value, 1):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return [], f"message {number} of {field!r} has no text 'content'"
        if message.get("role") not in ROLES:
            return (
                [],
                f"message {number} of {field!r} has the role {message.get('role')!r}, not one of {ROLES}",
            )
    if not any(m["role"] == "assistant" for m in value):
        return [], f"its {field!r} has no assistant turn, so nothing to learn"
    return [{"role": m["role"], "content": m["content"]} for m in value], ""


def _render(tokenizer: Any, messages: Sequence[Dict[str, str]], template: str, prompt: bool) -> str:
    text: str = tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=prompt
    )
    return text


def _chat(
    tokenizer: Any, messages: List[Dict[str, str]], template: str
) -> Tuple[str, List[Tuple[int, int]], str]:
    """The rendered chat and the character spans of its assistant turns."""
    whole = _render(tokenizer, messages, template, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], template, True) if index else ""
        through = _render(tokenizer, messages[: index + 1], template, False)
        if not (whole.startswith(through) and through.startswith(before)):
            return "", [], "the chat template renders an earlier turn differently once later turns follow"
        spans.append((len(before), len(through)))
    return whole, spans, ""


def _labelled(tokenizer: Any, text: str, spans: List[Tuple[int, int]]) -> Tuple[List[int], List[bool]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    kept = [any(s <= a and b <= e and b > a for s, e in spans) for a, b in offsets]
    return ids, kept


def _pair(tokenizer: Any, prompt: str, response: str) -> Tuple[List[int], List[bool]]:
    first = tokenizer(prompt)["input_ids"]  # the tokenizer's own start token, where it adds one
    second = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        second = [*second, tokenizer.eos_token_id]
    return [*first, *second], [False] * len(first) + [True] * len(second)


def render_row(row: Dict[str, Any], rendering: Rendering) -> Dict[str, Any]:
    """``row`` as ``input_ids``, ``labels`` (both cut at ``seq_len``), ``length`` (before the cut)
    and ``problem`` (empty, or why the row cannot be used)."""
    tokenizer, fields = tokenizer_of(rendering.tokenizer), rendering.fields
    problem = ""
    if rendering.format == "text":
        text, problem = _text(row.get(fields["text"]), fields["text"])
        ids = tokenizer(text)["input_ids"] if text is not None else []
        if text is not None and tokenizer.eos_token_id is not None:
            ids = [*ids, tokenizer.eos_token_id]
        kept = [True] * len(ids)
    elif rendering.format == "prompt_response":
        prompt, problem = _text(row.get(fields["prompt"]), fields["prompt"])
        response, problem_2 = _text(row.get(fields["response"]), fields["response"])
        problem = problem or problem_2
        if problem:
            ids, kept = [], []
        elif rendering.template is not None:
            chat = [{"role": "user", "content": str(prompt)}, {"role": "assistant", "content": str(response)}]
            text, spans, problem = _chat(tokenizer, chat, rendering.template)
            ids, kept = _labelled(tokenizer, text, spans)
        else:
            ids, kept = _pair(tokenizer, str(prompt), str(response))
    else:
        messages, problem = _messages(row.get(fields["messages"]), fields["messages"])
        ids, kept = [], []
        if not problem:
            assert rendering.template is not None
            text, spans, problem = _chat(tokenizer, messages, rendering.template)
            ids, kept = _labelled(tokenizer, text, spans)
    labels = [i if (k or rendering.train_on_prompt) else IGNORE for i, k in zip(ids, kept)]
    cut = rendering.seq_len
    return {"input_ids": ids[:cut], "labels": labels[:cut], "length": len(ids), "problem": problem}
