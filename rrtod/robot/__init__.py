"""The robot side: app sessions relayed to GPU hosts, their op logs, the sequence search, the
recorded sequences, and energy per inference. Nothing here is imported by ``rrtod.gpu``."""
