"""The child process of tokenizer.ChildBackend: parses one tokenizer.json, then answers one JSON line per
request on stdin ([method, *args]) with one line on stdout ({"ok": result} or {"error": message}), until stdin
closes. An unreadable file answers every request with its error."""

import json
import sys

from tokenizers import Tokenizer


def parse(tokenizer_file: str) -> Tokenizer:
    """The file's tokenizer; ValueError with the reason when it is malformed (also specdec's in-process parse)."""
    try:
        return Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"unreadable tokenizer ({e})") from None


def serve(tokenizer_file: str) -> None:
    try:
        tokenizer, failure = parse(tokenizer_file), None
    except ValueError as e:
        tokenizer, failure = None, str(e)
    calls = {
        "get_vocab_size": lambda with_added: tokenizer.get_vocab_size(with_added_tokens=with_added),
        "encode": lambda text, special: tokenizer.encode(text, add_special_tokens=special).ids,
        "decode": lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip),
        "token_to_id": lambda token: tokenizer.token_to_id(token),
    }
    for line in sys.stdin:
        method, *args = json.loads(line)
        try:
            reply = {"error": failure} if failure else {"ok": calls[method](*args)}
        except Exception as e:
            reply = {"error": f"{method} failed ({e})"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
