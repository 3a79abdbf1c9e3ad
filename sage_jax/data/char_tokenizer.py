"""A character tokenizer in Hugging Face form, for models trained from scratch on a CPU (the tool study,
configs/tools_arms.py): each printable ASCII character and the newline is one token, and two fence tokens are whole
("```python\\n" opens a code block, "```" closes one), so the markdown tool-call format pauses a row on the one token
that closes its block and never on the one that opens it. Anything else encodes as <unk>.

    --config.tokenizer_path=chars     # Tokenizer.from_pretrained("chars") makes it in memory (training, and
                                      # evaluating a workdir of such a run); an export saves it like any other
"""

from __future__ import annotations

import string

NAME = "chars"  # the tokenizer_path that names it
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")
FENCES = ("```python\n", "```")
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build():
    """A transformers PreTrainedTokenizerFast: <bos> in front where special tokens are added, <eos> its end."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character its own
    tok.decoder = decoders.Fuse()  # joined as written, no spaces between tokens
    tok.add_special_tokens(list(SPECIALS))
    tok.add_tokens([AddedToken(f, normalized=False) for f in FENCES])  # matched whole, the longest first
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>", clean_up_tokenization_spaces=False)
