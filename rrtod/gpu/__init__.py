"""The GPU side: the peer service that runs robots' sessions, sequence replay on the host, the
weight cache and the access rules. Nothing here is imported by ``rrtod.robot``."""
