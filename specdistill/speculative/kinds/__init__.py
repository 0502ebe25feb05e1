"""The kinds of drafter, one module each; importing this package registers them in `specs.KINDS`, in the
order serving.json's modes and the usage line list them. A new kind (MTP, Medusa) is a new module here and
its line below: the parser, the builders, the serving engines' settings and the records read it from there."""

from specdistill.speculative.kinds import draft_model, self_spec, ngram, suffix, hybrid, eagle3  # noqa: F401, I001  in this order
