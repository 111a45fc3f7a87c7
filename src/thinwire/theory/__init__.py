"""The IST theory lab: Shulgin & Richtarik, "Towards a Better Theoretical Understanding of
Independent Subnetwork Training", ICML 2024 (arXiv 2306.16484), reproduced on quadratics.

numpy only, except the "bridge" experiment, which runs thinwire's torch IST strategy on a
neural network beside the quadratics (torch imported inside that experiment alone). Modules, in
the order a run uses them:
  1. ``problems``     seeded distributed quadratics f_i(x) = 1/2 x^T L_i x - b_i^T x;
  2. ``methods``      GD, IST with Perm-q sketches (plain, scaled, preconditioned) cut by the
                      IST Partitioner's recipe, and Rand-k compressed GD, all as random affine maps;
  3. ``predictions``  x*, the limit point x_inf, the bias floor, Theorem 1's theta, the
                      stationary error, the 2x2 counterexample, computed from the problem;
  4. ``params``       experiment parameters as frozen dataclasses (defaults, help, bounds);
  5. ``lab``          the steps every experiment shares (simulate, average over seeds);
  6. ``exp_*``        the experiments, one a module, gathered by ``experiments`` into a
                      ``registry`` (the registry imports none of them); ``plots`` draws them;
  7. :mod:`thinwire.commands.theory` is ``thinwire theory``: every experiment's parameters
     as options.
"""
