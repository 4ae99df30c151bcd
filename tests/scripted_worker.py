"""The real worker, with replies scripted by the test: random weights never call a tool by themselves.

SCRIPTED_REPLIES holds a JSON list of ``[marker, reply]``: a request whose
templated prompt contains `marker` (the first that matches) is forced, token
by token, to generate `reply` and then end its turn, through a logits
processor added to its sequence. ``[marker, reply, "prefix"]`` forces only
the reply's first tokens, `reply`, and lets the model (under the request's
grammar, if it has one: the processor goes before it) write the rest.
Everything else (templating, batching, the streaming detokenizer, the reply
splitter, the frames) is the production path, unchanged; requests that
match no marker run as usual.
"""

import json
import os

from forcing import forced, prefixed, reply_ids
from mlxrt.worker import engine as engine_module
from mlxrt.worker.main import main

SCRIPT = json.loads(os.environ["SCRIPTED_REPLIES"])
_sequence = engine_module.Engine._sequence


def scripted_sequence(self, req, listener, queued_at):
    seq = _sequence(self, req, listener, queued_at)
    prompt = self.tokenizer.decode(seq.ids)
    entry = next((e for e in SCRIPT if e[0] in prompt), None)
    if entry is None:
        return seq
    if entry[2:] == ["prefix"]:
        ids = self.tokenizer.encode(entry[1], add_special_tokens=False)
        at = len(seq.processors) - (seq.constraint is not None)  # before the grammar: it still masks
        seq.processors.insert(at, prefixed(ids, self.vocab_size))
    else:
        seq.processors = [*seq.processors, forced(reply_ids(self.tokenizer, entry[1]), self.vocab_size)]
    return seq


engine_module.Engine._sequence = scripted_sequence

if __name__ == "__main__":
    main()
