"""What every stage shares: the result types (``Status``, ``Finding``, ``Report``), the errors and
warnings, the words of messages, the hooks a monitor owns, the torch.distributed plumbing (is it on,
shards and DTensors, the collectives), and the checks of a saved state's values.

Imports no other group of gradhealth. Something belongs here only when two stages or more need it.
"""
