"""The last module the fork server imports (actors/forkserver.py): it collects the imports'
garbage and freezes what is left alive, as a node does before its actor is made, so that
neither the server's own exit nor the nodes forked from it walk those objects again."""

import gc

gc.collect()
gc.freeze()
