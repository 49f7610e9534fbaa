"""What a bundle takes as text: a question, or a passage's text, must hold a word for each of
the tokenizers that read it: a token neither special nor unknown.

A visible character is not enough. A combining accent alone (U+0301) tokenises to nothing under
BERT's accent stripping, a private-use character (U+E000) to `[UNK]` or nothing, the replacement
character (U+FFFD) to nothing: the question encoder then encodes an empty question, and the
answer comes from nothing (an edit, likewise, indexes a passage of nothing). `ContentCheck`
refuses such text with a ValueError naming its field (`questions[1]`, `upserts[0].text`).

A title is a label beside a text that holds a word: it is refused only when the tokenizers read
nothing in it, or special tokens alone (`unknown_is_word`). A title of words the vocabulary
lacks reads as `[UNK]` like any such word in a text, and is kept: a small vocabulary (the
synthetic job's 225 whole words) has no "t" nor "Added", titles clients and scripts give.

Legend: none (no arrays here).
"""

import copy
import threading


class ContentCheck:
    """Checks texts against a bundle's tokenizers, by name ("question encoder", "generator").

    It tokenises with its own copies of them, one call at a time: a fast tokenizer keeps its
    truncation and padding as state between calls, so one shared with another thread's calls
    (an answer's, an edit's) could tokenise either wrongly.
    """

    def __init__(self, tokenizers: dict[str, object]):
        """Args:
        tokenizers: {name: tokenizer}; the same tokenizer under two names is copied once.
        """
        copies = {}  # id(tokenizer) -> its copy
        self._readers = {}  # name -> (copy, its special ids, its unknown token's id)
        for name, tokenizer in tokenizers.items():
            own = copies.setdefault(id(tokenizer), copy.deepcopy(tokenizer))
            unknown = tokenizer.unk_token_id
            special = frozenset(tokenizer.all_special_ids) - {unknown}
            self._readers[name] = (own, special, unknown)
        self._lock = threading.Lock()

    def why_empty(self, text: str, readers, *, unknown_is_word: bool = False) -> str | None:
        """Why `text` holds no word for one of the tokenizers named in `readers` (nothing, or
        only unknown or special tokens; with `unknown_is_word`, nothing or only special
        tokens), or None when each of them reads one in it."""
        with self._lock:
            for name in readers:
                tokenizer, special, unknown = self._readers[name]
                empty = special if unknown_is_word else special | {unknown}
                ids = tokenizer(text, add_special_tokens=False, truncation=False, verbose=False)
                ids = ids["input_ids"]
                if any(i not in empty for i in ids):
                    continue
                if not ids:
                    return f"the {name}'s tokenizer reads nothing in it"
                shown = tokenizer.convert_ids_to_tokens(sorted(set(ids))[:3])
                kinds = "special" if unknown_is_word else "unknown or special"
                return f"the {name}'s tokenizer reads only {kinds} tokens in it {shown}"
        return None

    def check(
        self, field: str, text: str, readers, what: str, *, unknown_is_word: bool = False
    ) -> None:
        """Raises ValueError naming `field` when `text` holds no word for one of the tokenizers
        named in `readers` (`why_empty`); `what` says what it should be ("a question")."""
        why = self.why_empty(text, readers, unknown_is_word=unknown_is_word)
        if why is not None:
            raise ValueError(f"{field}: expected {what} with a word in it; {why}")
