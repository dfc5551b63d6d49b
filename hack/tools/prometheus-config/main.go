// Command prometheus-config turns PodMonitors, ServiceMonitors and PrometheusRules into the Prometheus
// configuration and rule files the Prometheus Operator would give a Prometheus resource, by running the
// operator's own code (github.com/prometheus-operator/prometheus-operator/pkg/prometheus and
// pkg/operator) on objects read from YAML instead of from its informers:
//
//	prometheus-config -prometheus prometheus.yaml -out DIR objects.yaml...
//
// objects.yaml: YAML documents or Lists (`kubectl get ... -o yaml`, `helm template`) holding
// PodMonitors, ServiceMonitors, PrometheusRules and, for the namespace selectors, Namespaces (without
// them, every namespace an object names counts, unlabelled). It writes what the operator writes:
//
//	DIR/prometheus.yaml                    the configuration (the operator's Secret prometheus-NAME)
//	DIR/prometheus.env.yaml                the same with $(POD_NAME) and $(SHARD) expanded for the
//	                                       first replica, as the config-reloader sidecar writes it
//	DIR/rules/prometheus-NAME-rulefiles-0/ the rule files (the operator's ConfigMap), which the
//	                                       configuration names under /etc/prometheus/rules/
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus-operator/prometheus-operator/pkg/assets"
	"github.com/prometheus-operator/prometheus-operator/pkg/informers"
	"github.com/prometheus-operator/prometheus-operator/pkg/namespacelabeler"
	"github.com/prometheus-operator/prometheus-operator/pkg/operator"
	prompkg "github.com/prometheus-operator/prometheus-operator/pkg/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8slabels "k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/sets"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/yaml"
)

func main() {
	promFile := flag.String("prometheus", "", "YAML of the Prometheus resource (its selectors, version, intervals)")
	outDir := flag.String("out", "", "folder to write prometheus.yaml, prometheus.env.yaml and rules/ into")
	endpointSlice := flag.Bool("endpointslice", true, "the API serves discovery.k8s.io/v1 (the operator checks): "+
		"ServiceMonitors may then use role endpointslice, where spec.serviceDiscoveryRole asks for it")
	flag.Parse()
	if *promFile == "" || *outDir == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: prometheus-config -prometheus FILE -out DIR OBJECTS.yaml...")
		os.Exit(2)
	}
	if err := run(*promFile, *outDir, *endpointSlice, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "prometheus-config:", err)
		os.Exit(1)
	}
}

// objects is what the operator's informers would hold: one namespaced store per kind.
type objects struct {
	podMonitors, serviceMonitors, rules, namespaces cache.Indexer
}

func newIndexer() cache.Indexer {
	return cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}

func run(promFile, outDir string, endpointSlice bool, inputs []string) error {
	var p monitoringv1.Prometheus
	raw, err := os.ReadFile(promFile)
	if err != nil {
		return err
	}
	if err := yaml.UnmarshalStrict(raw, &p); err != nil {
		return fmt.Errorf("%s: %w", promFile, err)
	}
	objs := objects{newIndexer(), newIndexer(), newIndexer(), newIndexer()}
	seen := sets.New(p.Namespace)
	for _, in := range inputs {
		if err := objs.load(in, seen); err != nil {
			return fmt.Errorf("%s: %w", in, err)
		}
	}
	if len(objs.namespaces.List()) == 0 {
		for _, ns := range sets.List(seen) {
			_ = objs.namespaces.Add(&v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
		}
	}

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	nsInformer := cache.NewSharedIndexInformer(&cache.ListWatch{}, &v1.Namespace{}, 0, cache.Indexers{})
	for _, ns := range objs.namespaces.List() {
		_ = nsInformer.GetStore().Add(ns)
	}
	recorder := &record.FakeRecorder{} // nil Events channel: the operator's events are dropped
	metrics := operator.NewMetrics(prometheus.NewRegistry())

	ruleFiles, err := selectRules(&p, objs.rules, nsInformer, recorder, logger)
	if err != nil {
		return err
	}
	var ruleConfigMaps []string
	if len(ruleFiles) > 0 {
		// The operator packs the rule files into ConfigMaps of at most MaxConfigMapDataSize each;
		// a larger set than one ConfigMap holds is refused here rather than split.
		size := 0
		for _, content := range ruleFiles {
			size += len(content)
		}
		if size > operator.MaxConfigMapDataSize {
			return fmt.Errorf("the rule files (%d bytes) need more than one ConfigMap", size)
		}
		ruleConfigMaps = []string{fmt.Sprintf("prometheus-%s-rulefiles-0", p.Name)}
	}

	store := assets.NewStoreBuilder(noObjects{}, noObjects{})
	var opts []prompkg.ConfigGeneratorOption
	if endpointSlice {
		opts = append(opts, prompkg.WithEndpointSliceSupport())
	}
	cg, err := prompkg.NewConfigGenerator(logger, &p, opts...)
	if err != nil {
		return err
	}
	selector, err := prompkg.NewResourceSelector(logger, &p, store, nsInformer, metrics, recorder)
	if err != nil {
		return err
	}
	ctx := context.Background()
	sMons, err := selector.SelectServiceMonitors(ctx, listFn(objs.serviceMonitors))
	if err != nil {
		return err
	}
	pMons, err := selector.SelectPodMonitors(ctx, listFn(objs.podMonitors))
	if err != nil {
		return err
	}
	for _, rejected := range []int{len(sMons) - len(sMons.ValidResources()), len(pMons) - len(pMons.ValidResources())} {
		if rejected > 0 {
			return errors.New("the operator rejected a monitor (see its warning above)")
		}
	}
	conf, err := cg.GenerateServerConfiguration(&p, sMons.ValidResources(), pMons.ValidResources(),
		nil, nil, store, nil, nil, nil, ruleConfigMaps)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "prometheus-config: %d ServiceMonitors, %d PodMonitors, %d rule files selected\n",
		len(sMons), len(pMons), len(ruleFiles))
	return write(outDir, &p, conf, ruleConfigMaps, ruleFiles)
}

// selectRules is the operator's createOrUpdateRuleConfigMaps up to the ConfigMaps' content.
func selectRules(p *monitoringv1.Prometheus, rules cache.Indexer, nsInformer cache.SharedIndexInformer,
	recorder record.EventRecorder, logger *slog.Logger) (map[string]string, error) {
	namespaces := []string{p.Namespace}
	if p.Spec.RuleNamespaceSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(p.Spec.RuleNamespaceSelector)
		if err != nil {
			return nil, err
		}
		if namespaces, err = operator.ListMatchingNamespaces(sel, nsInformer); err != nil {
			return nil, err
		}
	}
	informer, err := informers.NewInformersForResource(storeFactory{rules},
		monitoringv1.SchemeGroupVersion.WithResource(monitoringv1.PrometheusRuleName))
	if err != nil {
		return nil, err
	}
	labeler := namespacelabeler.New(p.Spec.EnforcedNamespaceLabel, p.Spec.ExcludedFromEnforcement, true)
	version := operator.StringValOrDefault(p.Spec.Version, operator.DefaultPrometheusVersion)
	prs, err := operator.NewPrometheusRuleSelector(operator.PrometheusFormat, version, p.Spec.RuleSelector,
		labeler, informer, recorder, logger)
	if err != nil {
		return nil, err
	}
	files, rejected, err := prs.Select(namespaces)
	if err == nil && rejected > 0 {
		err = errors.New("the operator rejected a PrometheusRule (see its warning above)")
	}
	return files, err
}

func write(outDir string, p *monitoringv1.Prometheus, conf []byte, configMaps []string, ruleFiles map[string]string) error {
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(outDir, "prometheus.yaml"), conf, 0o644); err != nil {
		return err
	}
	// The StatefulSet gives replica 0 of shard 0 these; the config-reloader expands them.
	env := map[string]string{operator.PodNameEnvVar: fmt.Sprintf("prometheus-%s-0", p.Name), operator.ShardEnvVar: "0"}
	expanded, err := expandEnv(conf, env)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(outDir, "prometheus.env.yaml"), expanded, 0o644); err != nil {
		return err
	}
	names := make([]string, 0, len(ruleFiles))
	for name := range ruleFiles {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, cm := range configMaps {
		dir := filepath.Join(outDir, "rules", cm)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for _, name := range names {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(ruleFiles[name]), 0o644); err != nil {
				return err
			}
		}
	}
	return nil
}

var envRef = regexp.MustCompile(`\$\(([a-zA-Z_0-9]+)\)`)

// expandEnv replaces $(NAME) as the config-reloader does, refusing a name it is not given.
func expandEnv(conf []byte, env map[string]string) ([]byte, error) {
	var missing error
	out := envRef.ReplaceAllFunc(conf, func(ref []byte) []byte {
		name := string(envRef.FindSubmatch(ref)[1])
		v, ok := env[name]
		if !ok {
			missing = fmt.Errorf("the configuration refers to $(%s), which the generator does not set", name)
		}
		return []byte(v)
	})
	return out, missing
}

// load adds every object of `file` to its store and records the namespaces the objects name.
func (o objects) load(file string, seen sets.Set[string]) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	dec := k8syaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		var doc runtime.RawExtension
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
		if len(bytes.TrimSpace(doc.Raw)) == 0 || string(doc.Raw) == "null" {
			continue
		}
		if err := o.add(doc.Raw, seen); err != nil {
			return err
		}
	}
}

func (o objects) add(raw []byte, seen sets.Set[string]) error {
	var meta struct {
		metav1.TypeMeta `json:",inline"`
		Items           []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(raw, &meta); err != nil {
		return err
	}
	var obj metav1.Object
	var store cache.Indexer
	switch meta.Kind {
	case "List":
		for _, item := range meta.Items {
			if err := o.add(item, seen); err != nil {
				return err
			}
		}
		return nil
	case monitoringv1.PodMonitorsKind:
		obj, store = &monitoringv1.PodMonitor{}, o.podMonitors
	case monitoringv1.ServiceMonitorsKind:
		obj, store = &monitoringv1.ServiceMonitor{}, o.serviceMonitors
	case monitoringv1.PrometheusRuleKind:
		obj, store = &monitoringv1.PrometheusRule{}, o.rules
	case "Namespace":
		obj, store = &v1.Namespace{}, o.namespaces
	default:
		return nil // whatever else a chart renders: not the operator's input
	}
	if err := json.Unmarshal(raw, obj); err != nil {
		return fmt.Errorf("%s: %w", meta.Kind, err)
	}
	if meta.Kind != "Namespace" {
		if obj.GetNamespace() == "" {
			return fmt.Errorf("%s %s has no namespace", meta.Kind, obj.GetName())
		}
		seen.Insert(obj.GetNamespace())
	}
	return store.Add(obj)
}

func listFn(store cache.Indexer) prompkg.ListAllByNamespaceFn {
	return func(ns string, selector k8slabels.Selector, appendFn cache.AppendFunc) error {
		return cache.ListAllByNamespace(store, ns, selector, appendFn)
	}
}

// storeFactory serves one store, for all namespaces, where the operator has an informer per namespace.
type storeFactory struct{ store cache.Indexer }

func (f storeFactory) Namespaces() sets.Set[string] { return sets.New(v1.NamespaceAll) }

func (f storeFactory) ForResource(_ string, r schema.GroupVersionResource) (informers.InformLister, error) {
	inf := cache.NewSharedIndexInformer(&cache.ListWatch{}, &monitoringv1.PrometheusRule{}, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	for _, obj := range f.store.List() {
		if err := inf.GetIndexer().Add(obj); err != nil {
			return nil, err
		}
	}
	return lister{inf, cache.NewGenericLister(inf.GetIndexer(), r.GroupResource())}, nil
}

type lister struct {
	inf cache.SharedIndexInformer
	l   cache.GenericLister
}

func (l lister) Informer() cache.SharedIndexInformer { return l.inf }
func (l lister) Lister() cache.GenericLister         { return l.l }

// noObjects answers every Secret or ConfigMap a monitor refers to with an error: the chart's monitors
// refer to none, and a generator that made one up would not be the operator's output.
type noObjects struct{}

func (noObjects) Secrets(ns string) corev1client.SecretInterface       { return noSecrets{ns: ns} }
func (noObjects) ConfigMaps(ns string) corev1client.ConfigMapInterface { return noConfigMaps{ns: ns} }

type noSecrets struct {
	corev1client.SecretInterface
	ns string
}

func (s noSecrets) Get(_ context.Context, name string, _ metav1.GetOptions) (*v1.Secret, error) {
	return nil, fmt.Errorf("secret %s/%s: the generator reads no Secrets", s.ns, name)
}

type noConfigMaps struct {
	corev1client.ConfigMapInterface
	ns string
}

func (c noConfigMaps) Get(_ context.Context, name string, _ metav1.GetOptions) (*v1.ConfigMap, error) {
	return nil, fmt.Errorf("configmap %s/%s: the generator reads no ConfigMaps", c.ns, name)
}
