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

from mlxrt.worker.hf_index import remember_transformers_index

remember_transformers_index()  # as the worker does, before the engine's imports bring in transformers

from forcing import forced, prefixed, reply_ids  # noqa: E402
from mlxrt.worker import engine as engine_module  # noqa: E402
from mlxrt.worker.main import main  # noqa: E402

SCRIPT = json.loads(os.environ["SCRIPTED_REPLIES"])
_sequences = engine_module.Engine._sequences


def scripted_sequences(self, req, listener, queued_at):
    return [script(self, seq) for seq in _sequences(self, req, listener, queued_at)]


def script(self, seq):
    prompt = self.tokenizer.decode(seq.ids)
    entry = next((e for e in SCRIPT if e[0] in prompt), None)
    if entry is None:
        return seq
    if entry[2:] == ["prefix"]:
        ids = self.tokenizer.encode(entry[1], add_special_tokens=False)[seq.resumed:]
        at = len(seq.processors) - (seq.constraint is not None)  # before the grammar: it still masks
        seq.processors.insert(at, prefixed(ids, self.vocab_size))
    else:  # a resumed reply goes on where the worker that died left it
        ids = reply_ids(self.tokenizer, entry[1])
        seq.processors = [*seq.processors, forced(ids[min(seq.resumed, len(ids) - 1):], self.vocab_size)]
    return seq


engine_module.Engine._sequences = scripted_sequences

if __name__ == "__main__":
    main()
