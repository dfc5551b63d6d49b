//go:build tools

// Package tools records the API package controller-gen reads, so that
// `go mod tidy` keeps every module it needs in go.mod and go.sum.
package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
)
