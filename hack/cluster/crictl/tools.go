//go:build tools

// Package tools records the one command this module builds, so `go mod tidy` keeps its requirements.
package tools

import _ "sigs.k8s.io/cri-tools/cmd/crictl"
