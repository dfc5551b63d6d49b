//go:build tools

// Package tools records the main package hack/tools/build.sh compiles, so that
// `go mod tidy` keeps every module it needs in go.mod and go.sum.
package tools

import (
	_ "sigs.k8s.io/controller-tools/cmd/controller-gen"
)
