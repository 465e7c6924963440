"""Process rewards: retrospective ``r_aux`` labels (section 3) and advantage estimators (section 5).

- ``retrospective``: ``r_aux`` from (format flag, action flag, o_t, o_{t+1})
- ``advantages``: registered estimators ``gae_env``, ``gae_env_aux``, ``td1``, ``q_minus_v``
- ``label``: ``qevolve label``, writing V, Q, r_aux and the advantage on every turn of a buffer
"""
