"""The trio shell: the tasks and handles that move bytes between sockets and the sans-IO
rooms (:mod:`trio_dpcoord.core`, :mod:`trio_dpcoord.routing`), one owner task per socket.

=======================  =========================================================================
module                   what it runs
=======================  =========================================================================
``coordinator``          :func:`~trio_dpcoord.open_coordinator`: the core and its pumps
``coordinator_sockets``  its sockets: opened, monitored and bound
``supervision``          its pumps restarted in place after a failure, with a recovering core
``frontend``             :func:`~trio_dpcoord.open_frontend`: a front-end of a standalone
                         coordinator
``engine_client``        :func:`~trio_dpcoord.open_engine_client`: vLLM's engine-core protocol,
                         the coordinator inside
``monitor``              connection monitors (engines and peers coming and going)
``endpoints``            addresses, binding policy and liveness settings
``tasks``                the task nursery every entry point runs its tasks in
``view``                 what every handle with a coordinator behind it answers
=======================  =========================================================================

Private: the public names are exported by :mod:`trio_dpcoord`.
"""
