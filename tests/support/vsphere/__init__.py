"""VMware's vcsim (simulator, built from vcsim/main.go), a lab to try by hand (lab), a
deployer on it (pipeline)."""
