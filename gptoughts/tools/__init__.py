"""Commands built on top of whole runs (``bench``, ``tune``): they assemble through ``gptoughts.training.build``
and nothing below this package imports them."""
