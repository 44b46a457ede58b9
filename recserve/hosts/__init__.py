"""Hosts on one machine: network namespaces joined by a bridge (``netns.py``), each with its own
address, links that go down and up and carry rate limits; and a fault-injecting TCP relay
(``relay.py``) that gives a host's inbound connections delay, jitter and loss under a named
network profile, since the kernel here has no ``netem``. ``recserve cluster up --hosts netns``
and the fault tests put every server of a cluster on a host of its own with them."""
