"""keel tokenize: text files -> an llm.c token file (data.name = "tokens"), ahead of time.

Run by `keel tokenize` with keel's venv Python (never in the training loop). The tokenizer is
either a tokenizer.json the user gives (GPT-2's byte-level BPE, or any Hugging Face
`tokenizers` file) or a byte-level BPE trained here on the user's text with Hugging Face
`tokenizers` (PyPI), saved beside the output. No network is used.

Each input file is one document; the end-of-text token (--eot, GPT-2's "<|endoftext|>" by
default, when the vocabulary has it) is put before every document, as llm.c does. The output
is llm.c's .bin: a header of 256 int32 (magic 20240520, version 1, uint16 tokens when the
vocabulary fits 16 bits; else magic 20240801, version 7, uint32), then the tokens. Files are
written whole or not at all (a temporary file renamed into place, removed if the write fails).

Before any work the output paths are checked (check_outputs): no two of --out, --val-out and the
tokenizer --train-bpe saves may be one file, none may be an input (a text file or --tokenizer)
or a directory, and an existing file is replaced only when it is what this tool writes there
(a token file for --out/--val-out, a tokenizer.json for the tokenizer) or empty: a rerun
overwrites its own previous outputs, never the user's other files.

Exit codes: 0 done; 2 bad usage or input (a missing or unreadable text file, a tokenizer.json
that does not load, a vocabulary size out of range, an output path that is refused), naming it;
1 anything else.
"""

import argparse
import json
import os
import struct
import sys

MAGIC_U16, VERSION_U16 = 20240520, 1
MAGIC_U32, VERSION_U32 = 20240801, 7


class InputError(Exception):
    pass


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="keel tokenize",
        description="Turn text files into an llm.c token file for data.name = \"tokens\" "
        "(docs/models.md). Each file is one document.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", metavar="JSON", help="a tokenizer.json (e.g. GPT-2's) to encode with")
    src.add_argument("--train-bpe", metavar="VOCAB", type=int,
                     help="train a byte-level BPE of VOCAB tokens (>= 257) on the input files")
    p.add_argument("--save-tokenizer", metavar="JSON",
                   help="where --train-bpe saves its tokenizer.json (default: OUT with .tokenizer.json)")
    p.add_argument("--out", required=True, help="the token file to write (e.g. data/train.bin)")
    p.add_argument("--val-out", help="also write a held-out token file (data.test_path)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="with --val-out: the fraction of the documents (the last ones) held out; default 0.1")
    p.add_argument("--eot", default=None,
                   help="the token put before every document (default: GPT-2's <|endoftext|>, when the "
                        "vocabulary has it; one given here must be in it; \"\" for none)")
    p.add_argument("files", nargs="+", help="text files (UTF-8), one document each")
    a = p.parse_args(argv)
    a.eot_given = a.eot is not None
    if a.eot is None:
        a.eot = "<|endoftext|>"
    if a.train_bpe is not None and not 257 <= a.train_bpe <= 1 << 24:
        p.error(f"--train-bpe {a.train_bpe}: a byte-level BPE needs 257 to 16777216 tokens")
    if a.val_out is not None and not 0 < a.val_fraction < 1:
        p.error(f"--val-fraction {a.val_fraction}: must be between 0 and 1")
    if a.val_out is not None and len(a.files) < 2:
        p.error("--val-out holds out whole documents: give at least two files")
    return a


def tokenizer_path(args):
    """Where --train-bpe saves its tokenizer.json (None with --tokenizer, which saves nothing)."""
    if args.train_bpe is None:
        return None
    return args.save_tokenizer or os.path.splitext(args.out)[0] + ".tokenizer.json"


def is_token_file(path):
    """An llm.c .bin as write_token_file writes it: the header's magic and version, and a size
    that holds exactly the header's count of tokens."""
    size = os.path.getsize(path)
    if size < 1024:
        return False
    with open(path, "rb") as f:
        magic, version, count = struct.unpack("=3i", f.read(12))
    width = {(MAGIC_U16, VERSION_U16): 2, (MAGIC_U32, VERSION_U32): 4}.get((magic, version))
    return width is not None and count >= 0 and size == 1024 + count * width


def is_tokenizer_json(path):
    """A tokenizer.json as Hugging Face tokenizers saves it: a JSON object with "version" and a
    "model" object."""
    with open(path, "rb") as f:
        if f.read(64).lstrip()[:1] != b"{":
            return False
        f.seek(0)
        try:
            d = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return False
    return isinstance(d, dict) and "version" in d and isinstance(d.get("model"), dict)


def same_file(a, b):
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links, bind mounts
    except OSError:
        return False


def check_outputs(args):
    """Refuses (InputError, exit 2, nothing written) output paths that would lose data or could
    not be written: see the module docstring."""
    outputs = [("--out", args.out, is_token_file, "a token file (llm.c's .bin, as keel tokenize writes)")]
    if args.val_out is not None:
        outputs.append(("--val-out", args.val_out, is_token_file,
                        "a token file (llm.c's .bin, as keel tokenize writes)"))
    saved = tokenizer_path(args)
    if saved is not None:
        flag = "--save-tokenizer" if args.save_tokenizer else "--save-tokenizer (default: --out with .tokenizer.json)"
        outputs.append((flag, saved, is_tokenizer_json, "a tokenizer.json"))
    inputs = ([("--tokenizer", args.tokenizer)] if args.tokenizer is not None else []) + [
        ("the input file", f) for f in args.files]

    for flag, path, _, _ in outputs:
        if path == "":
            raise InputError(f"{flag}: an empty path; give the path of a file")
        if path.endswith(os.sep) or os.path.isdir(path):
            raise InputError(f"{flag} {path}: is a directory; give the path of a file")
        if os.path.exists(path) and not os.path.isfile(path):
            raise InputError(f"{flag} {path}: exists and is not a regular file; refusing to replace it")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise InputError(f"{flag} {path}: {parent} is not a directory")

    for i, (flag, path, _, _) in enumerate(outputs):
        for other_flag, other, _, _ in outputs[:i]:
            if same_file(path, other):
                raise InputError(f"{other_flag} and {flag} are the same file ({os.path.realpath(path)}): "
                                 "one would overwrite the other; give them different paths")
        for in_flag, inp in inputs:
            if same_file(path, inp):
                real = os.path.realpath(path)
                where = f" ({real})" if real not in (path, inp) else ""
                raise InputError(f"{flag} {path} is {in_flag} {inp}{where}: writing it would destroy that "
                                 f"input; give {flag} another path")

    for flag, path, is_own, what in outputs:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            continue
        try:
            own = is_own(path)
        except OSError as e:
            raise InputError(f"{flag} {path}: exists and cannot be read to check it ({e.strerror})") from None
        if not own:
            raise InputError(f"{flag} {path}: exists and is not {what}; refusing to overwrite it: "
                             "remove it or give another path")


def read_documents(paths):
    docs = []
    for path in paths:
        if not os.path.isfile(path):
            raise InputError(f"{path}: not a regular file" if os.path.exists(path) else f"{path}: no such file")
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(f.read())
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise InputError(f"{path}: {e.strerror}") from None
    return docs


def load_tokenizer(args):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        print("keel tokenize: error: the Python package `tokenizers` is missing from "
              f"{sys.executable}; scripts/setup.sh installs it into keel's venv", file=sys.stderr)
        sys.exit(1)
    if args.tokenizer is not None:
        if not os.path.isfile(args.tokenizer):
            raise InputError(f"{args.tokenizer}: no such tokenizer file")
        try:
            return Tokenizer.from_file(args.tokenizer), None
        except Exception as e:  # tokenizers raises its own exception types
            raise InputError(f"{args.tokenizer}: not a tokenizer.json this tokenizers reads ({e})") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [args.eot] if args.eot else []
    trainer = trainers.BpeTrainer(vocab_size=args.train_bpe, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(args.files, trainer)
    return tok, tokenizer_path(args)


def save_tokenizer(tok, path):
    """tok.save, whole or not at all, as write_token_file writes."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def encode(tok, docs, eot):
    eot_id = tok.token_to_id(eot) if eot else None
    out = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        if eot_id is not None:
            out.append(eot_id)
        out.extend(enc.ids)
    return out


def check_count(path, tokens):
    if len(tokens) >= 1 << 31:
        raise InputError(f"{path}: {len(tokens)} tokens do not fit llm.c's int32 count; split the input")


def write_token_file(path, tokens, vocab):
    import numpy as np

    wide = vocab > 1 << 16
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1] = (MAGIC_U32, VERSION_U32) if wide else (MAGIC_U16, VERSION_U16)
    check_count(path, tokens)
    header[2] = len(tokens)
    data = np.asarray(tokens, dtype=np.uint32 if wide else np.uint16)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):  # the write failed: leave no partial file behind
            os.remove(tmp)
    return "uint32" if wide else "uint16"


def main(argv):
    args = parse_args(argv)
    try:
        check_outputs(args)  # before any work: nothing is written when a path is refused
        docs = read_documents(args.files)
        tok, saved = load_tokenizer(args)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if args.eot and tok.token_to_id(args.eot) is None:
            if args.eot_given:  # asked for by name: never dropped silently
                raise InputError(f"--eot {args.eot!r}: not a token of the tokenizer's vocabulary "
                                 "(\"\" writes no separator)")
            print(f"keel tokenize: the vocabulary has no {args.eot!r}: documents are not separated "
                  "(--eot names another token)", file=sys.stderr)
        n_val = 0
        if args.val_out is not None:
            n_val = min(len(docs) - 1, max(1, round(len(docs) * args.val_fraction)))
        train = encode(tok, docs[: len(docs) - n_val], args.eot)
        check_count(args.out, train)
        val = encode(tok, docs[len(docs) - n_val:], args.eot) if n_val else []
        check_count(args.val_out, val)
        if saved:  # after every check, so a refused run writes nothing
            save_tokenizer(tok, saved)
        dtype = write_token_file(args.out, train, vocab)
        print(f"{args.out}: {len(train)} {dtype} tokens from {len(docs) - n_val} document(s)")
        if n_val:
            write_token_file(args.val_out, val, vocab)
            print(f"{args.val_out}: {len(val)} {dtype} tokens from {n_val} document(s)")
        if saved:
            short = f"; asked for {args.train_bpe}: the text holds no more merges" if vocab < args.train_bpe else ""
            print(f"{saved}: the trained tokenizer ({vocab} tokens{short})")
        print(f"train with: --data.name=tokens --data.path={args.out}"
              + (f" --data.test_path={args.val_out}" if n_val else "") + f" --model.vocab={vocab}")
        return 0
    except InputError as e:
        print(f"keel tokenize: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # not the user's input: exit 1, with the reason, not a traceback
        print(f"keel tokenize: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
